//! Channels every instance hears at once: a slot freed on one instance is heard by every other
//! waiting for one ([`Broadcast::hear`](mcp_ratelimit_kernel::store::Broadcast::hear)). A
//! subscription takes a connection of its own (one that can do nothing else), kept open while
//! anyone listens and opened again when it drops; meanwhile the listeners ask on their own
//! schedule, so a lost message delays, never strands, what it announced.

use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;

use super::RedisStore;

/// The first pause before a subscription that failed is tried again; it doubles, up to a second.
const FIRST_PAUSE: Duration = Duration::from_millis(50);

impl RedisStore {
    /// Hears `channel` in a task of its own until the receiver (and every clone of it) is
    /// dropped: its value counts what was heard, and moves once more whenever the subscription is
    /// opened again, as messages may have been missed while it was not.
    pub fn hear_channel(&self, channel: &str) -> watch::Receiver<u64> {
        let (heard, receiver) = watch::channel(0u64);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(target: "mcp_ratelimit::store::redis", channel, "cannot subscribe outside the runtime");
            return receiver;
        };
        let subscription = Subscription {
            client: self.listener.clone(),
            address: self.address.clone(),
            timeout: self.timeout,
            channel: channel.to_owned(),
        };
        runtime.spawn(subscription.run(heard));
        receiver
    }
}

/// One channel heard on one node.
struct Subscription {
    client: ::redis::Client,
    /// `host:port`, for messages (the client's URL may carry a password).
    address: String,
    timeout: Duration,
    channel: String,
}

impl Subscription {
    async fn run(self, heard: watch::Sender<u64>) {
        let bump = || heard.send_modify(|n| *n = n.saturating_add(1));
        let mut pause = FIRST_PAUSE;
        let mut down = false;
        loop {
            let opening = async {
                let mut pubsub = self.client.get_async_pubsub().await?;
                pubsub.subscribe(&self.channel).await?;
                Ok::<_, ::redis::RedisError>(pubsub)
            };
            match tokio::time::timeout(self.timeout, opening).await {
                Ok(Ok(pubsub)) => {
                    if down {
                        tracing::info!(target: "mcp_ratelimit::store::redis", channel = %self.channel, address = %self.address, "subscribed again");
                    }
                    pause = FIRST_PAUSE;
                    // What was said while nobody listened is lost: whoever listens looks again.
                    bump();
                    let mut messages = pubsub.into_on_message();
                    loop {
                        tokio::select! {
                            () = heard.closed() => return,
                            message = messages.next() => match message {
                                Some(_) => bump(),
                                None => break,
                            },
                        }
                    }
                    tracing::warn!(target: "mcp_ratelimit::store::redis", channel = %self.channel, address = %self.address, "the subscription dropped; subscribing again");
                    down = true;
                }
                Ok(Err(error)) if !down => {
                    tracing::warn!(target: "mcp_ratelimit::store::redis", channel = %self.channel, address = %self.address, %error, "cannot subscribe; trying again");
                    down = true;
                }
                Err(_) if !down => {
                    tracing::warn!(target: "mcp_ratelimit::store::redis", channel = %self.channel, address = %self.address, "cannot subscribe within the store timeout; trying again");
                    down = true;
                }
                Ok(Err(_)) | Err(_) => {}
            }
            tokio::select! {
                () = heard.closed() => return,
                () = tokio::time::sleep(pause) => {}
            }
            pause = pause.saturating_mul(2).min(Duration::from_secs(1));
        }
    }
}
