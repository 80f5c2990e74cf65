//! The guard's admission, in its stages: the scopes a call is checked against ([`plan`]), every
//! one decided at once on the store (`decide`, with the insurance limiter while a shared store
//! cannot), and what the decisions say to the caller and the operator ([`report`]).

pub(super) mod decide;
pub mod plan;
pub mod report;
