//! What follows an admitted call's work: its price settled from what it used ([`settle`]), its
//! answer compared with the ones before it (loops by answers, [`progress`]), and a call that asked
//! its caller for input taken up again as the same call ([`resume`]).

pub mod progress;
pub mod resume;
pub mod settle;
