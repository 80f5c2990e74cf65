//! Job classes: the kinds of work the account's queue tells apart, given to it as data.
//!
//! The queue, its round robin and the job book know no kind of job by name. Each job is of a
//! [`JobClass`] — how soon it is worth polling, how far apart its submissions must be, how many of
//! it may wait — and they read those numbers. The paid API's two classes, images and videos, are
//! built from `[upstream]` here, in [`JobClasses::from_config`]: a third class is one more entry
//! there (with its keys in the config), and no code in the queue.

use std::sync::Arc;

use crate::clock::Nanos;
use crate::config::UpstreamConfig;

/// One class of job, as the queue and the job book treat it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobClass {
    /// What it is called (`image`, `video`); a class with a gap names its key in a shared store
    /// after it (`{upstream}video_gap`).
    pub name: &'static str,
    /// What the `predict_id` of one of its jobs starts with while the upstream has not named it.
    pub id_prefix: &'static str,
    /// How long after a change one of its jobs is worth polling (`next_poll_in_seconds`).
    pub poll_hint: Nanos,
    /// The least time between two of its submissions to the upstream, across all callers. A class
    /// that has one (even 0) always waits its turn in the queue: it never takes a free slot at the
    /// door.
    pub min_gap: Option<Nanos>,
    /// How many of its jobs may wait, within the queue's total (`None`: only the total holds).
    pub queue_max: Option<usize>,
}

impl JobClass {
    /// A class named `name` that is neither spaced nor counted apart from the others.
    pub fn plain(name: &'static str) -> Self {
        Self { name, id_prefix: "", poll_hint: Nanos::ZERO, min_gap: None, queue_max: None }
    }
}

/// Which class a job is of: its place in the [`JobClasses`] its queue was built with. A class
/// the queue does not have is treated as neither spaced nor counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClassId(usize);

impl ClassId {
    /// Its place in the list.
    pub fn index(self) -> usize {
        self.0
    }
}

/// The paid API's image jobs, in [`JobClasses::from_config`].
pub const IMAGE: ClassId = ClassId(0);
/// The paid API's video jobs, in [`JobClasses::from_config`].
pub const VIDEO: ClassId = ClassId(1);

/// The classes a queue tells apart, in the order their [`ClassId`]s number them. Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobClasses(Arc<[JobClass]>);

impl JobClasses {
    /// The id of the one class of [`JobClasses::one`].
    pub const ONLY: ClassId = ClassId(0);

    /// These classes, numbered in this order.
    pub fn new(classes: Vec<JobClass>) -> Self {
        Self(classes.into())
    }

    /// One class, `name`, neither spaced nor counted apart: a queue whose jobs are all alike (a
    /// proxied server's calls, the simulator's jobs). Its id is [`JobClasses::ONLY`].
    pub fn one(name: &'static str) -> Self {
        Self::new(vec![JobClass::plain(name)])
    }

    /// The paid API's classes, from `[upstream]`: [`IMAGE`] (polled every `image_poll_seconds`)
    /// and [`VIDEO`] (polled every `video_poll_seconds`, one submission per `video_min_gap_ms`,
    /// at most `video_queue_max` waiting).
    pub fn from_config(up: &UpstreamConfig) -> Self {
        // In the order of their ids.
        Self::new(vec![
            JobClass { id_prefix: "i", poll_hint: Nanos::from_secs(up.image_poll_seconds), ..JobClass::plain("image") },
            JobClass {
                id_prefix: "v",
                poll_hint: Nanos::from_secs(up.video_poll_seconds),
                min_gap: Some(Nanos::from_millis(up.video_min_gap_ms)),
                queue_max: Some(up.video_queue_max),
                ..JobClass::plain("video")
            },
        ])
    }

    /// The class `id` names, if it is one of these.
    pub fn get(&self, id: ClassId) -> Option<&JobClass> {
        self.0.get(id.0)
    }

    /// Each class with its id, in order.
    pub fn iter(&self) -> impl Iterator<Item = (ClassId, &JobClass)> {
        self.0.iter().enumerate().map(|(i, class)| (ClassId(i), class))
    }

    /// How many classes there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn the_paid_apis_classes_are_numbered_as_their_ids_say_and_read_their_keys() {
        let config = Config::defaults(&crate::config::Catalogue::learned()).expect("defaults");
        let up = &config.upstream;
        let classes = JobClasses::from_config(up);
        let (image, video) = (classes.get(IMAGE).expect("image"), classes.get(VIDEO).expect("video"));
        assert_eq!((image.name, video.name), ("image", "video"));
        assert_eq!(image.poll_hint, Nanos::from_secs(up.image_poll_seconds));
        assert_eq!((image.min_gap, image.queue_max), (None, None));
        assert_eq!(video.poll_hint, Nanos::from_secs(up.video_poll_seconds));
        assert_eq!(video.min_gap, Some(Nanos::from_millis(up.video_min_gap_ms)));
        assert_eq!(video.queue_max, Some(up.video_queue_max));
    }
}
