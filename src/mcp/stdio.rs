//! MCP over stdin/stdout, every line answered.
//!
//! rmcp's stdio transport drops a line that is not JSON, and one longer than its 16 MiB limit,
//! without a word (so as not to answer garbage with more), and the client that sent it waits out
//! its timeout. [`frame`] puts a framing check between the pipes and rmcp, which still does all
//! of JSON-RPC and MCP: each line is passed to rmcp whole if it is JSON within the limit;
//! otherwise the client is answered at once, `id: null` (an id cannot be read from it):
//!
//! - a line that is not JSON: `-32700` (parse error);
//! - a line over [`MAX_LINE_BYTES`] (its newline included, as rmcp counts it): `-32600`, once
//!   the limit is reached; the rest of the line is read and dropped as it arrives, never held.
//!
//! A blank line is skipped, as rmcp skips it. Answers are written between rmcp's own lines,
//! never inside one. Used by `mcp-ratelimit stdio` and `proxy --stdio`.

use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, DuplexStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// The longest line rmcp takes, its newline included (`DEFAULT_MAX_LINE_LENGTH`, 16 MiB): a
/// longer one is answered here instead of dropped there.
pub const MAX_LINE_BYTES: usize = rmcp::transport::async_rw::DEFAULT_MAX_LINE_LENGTH;

/// How much of rmcp's output, and of the client's input, is in flight between the tasks.
const PIPE_BYTES: usize = 64 * 1024;

/// Answers waiting to be written; the reader waits when they are (stdout is not being read).
const PENDING_ANSWERS: usize = 64;

/// How long [`Framing::finish`] waits for rmcp's last lines to reach the output.
const FLUSH: Duration = Duration::from_secs(5);

/// The two tasks between the pipes and rmcp.
#[derive(Debug)]
pub struct Framing {
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

impl Framing {
    /// Once rmcp's service has ended: writes what it left, and stops reading.
    pub async fn finish(self) {
        let _ = tokio::time::timeout(FLUSH, self.writer).await;
        self.reader.abort();
    }
}

/// rmcp's side of `input` and `output` (a transport: what it reads, what it writes), with every
/// line checked on the way in; and the tasks doing it.
pub fn frame<R, W>(input: R, output: W) -> ((DuplexStream, DuplexStream), Framing)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (to_rmcp, rmcp_reads) = tokio::io::duplex(PIPE_BYTES);
    let (rmcp_writes, from_rmcp) = tokio::io::duplex(PIPE_BYTES);
    let (answers, answered) = mpsc::channel(PENDING_ANSWERS);
    let reader = tokio::spawn(check_lines(input, to_rmcp, answers));
    let writer = tokio::spawn(write_lines(from_rmcp, answered, output));
    ((rmcp_reads, rmcp_writes), Framing { reader, writer })
}

/// A JSON-RPC error answering a line no id can be read from.
fn answer(code: i64, message: &str) -> Vec<u8> {
    let mut line = json!({"jsonrpc": "2.0", "id": null, "error": {"code": code, "message": message}}).to_string();
    line.push('\n');
    line.into_bytes()
}

/// Reads `input` a line at a time, never holding more than [`MAX_LINE_BYTES`] of one: JSON lines
/// go to rmcp as they came, the others are answered.
async fn check_lines<R: AsyncRead + Unpin>(input: R, mut to_rmcp: DuplexStream, answers: mpsc::Sender<Vec<u8>>) {
    let mut input = BufReader::with_capacity(PIPE_BYTES, input);
    let mut line: Vec<u8> = Vec::new();
    let mut skipping = false;
    loop {
        let Ok(available) = input.fill_buf().await else { return };
        if available.is_empty() {
            // The end: a last line without its newline is not a message (rmcp drops it too).
            return;
        }
        let newline = available.iter().position(|b| *b == b'\n');
        let take = newline.map_or(available.len(), |at| at + 1);
        if skipping {
            input.consume(take);
            skipping = newline.is_none();
            continue;
        }
        if line.len().saturating_add(take) > MAX_LINE_BYTES {
            line = Vec::new();
            input.consume(take);
            skipping = newline.is_none();
            tracing::debug!(max = MAX_LINE_BYTES, "stdin: a line over the limit, answered and skipped");
            let message = format!(
                "Invalid Request: a message longer than {MAX_LINE_BYTES} bytes (with its newline) was skipped; send \
                 smaller messages."
            );
            if answers.send(answer(-32600, &message)).await.is_err() {
                return;
            }
            continue;
        }
        line.extend_from_slice(&available[..take]);
        input.consume(take);
        if newline.is_none() {
            continue;
        }
        let text = line.strip_suffix(b"\n").unwrap_or(&line);
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        let text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
        if !text.trim_ascii().is_empty() {
            match serde_json::from_slice::<serde::de::IgnoredAny>(text) {
                Ok(_) => {
                    if to_rmcp.write_all(&line).await.is_err() {
                        return;
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, "stdin: a line that is not JSON, answered -32700");
                    let message = format!("Parse error: the message is not JSON ({error}).");
                    if answers.send(answer(-32700, &message)).await.is_err() {
                        return;
                    }
                }
            }
        }
        line.clear();
        if line.capacity() > PIPE_BYTES {
            line = Vec::new(); // a large message's buffer is not kept for the small ones after it
        }
    }
}

/// Copies rmcp's output to `output`, writing the answers of [`check_lines`] only between lines.
async fn write_lines<W: AsyncWrite + Unpin>(
    mut from_rmcp: DuplexStream,
    mut answered: mpsc::Receiver<Vec<u8>>,
    mut output: W,
) {
    let mut buffer = vec![0u8; PIPE_BYTES];
    let (mut rmcp_open, mut answers_open) = (true, true);
    let mut between_lines = true;
    while rmcp_open || answers_open {
        let wrote = tokio::select! {
            read = from_rmcp.read(&mut buffer), if rmcp_open => match read {
                Ok(0) | Err(_) => {
                    rmcp_open = false;
                    Ok(())
                }
                Ok(n) => {
                    let chunk = &buffer[..n];
                    match chunk.iter().rposition(|b| *b == b'\n') {
                        Some(last) => {
                            let (lines, rest) = chunk.split_at(last + 1);
                            let mut wrote = output.write_all(lines).await;
                            while wrote.is_ok() {
                                let Ok(line) = answered.try_recv() else { break };
                                wrote = output.write_all(&line).await;
                            }
                            between_lines = rest.is_empty();
                            match wrote {
                                Ok(()) => output.write_all(rest).await,
                                Err(error) => Err(error),
                            }
                        }
                        None => {
                            between_lines = false;
                            output.write_all(chunk).await
                        }
                    }
                }
            },
            line = answered.recv(), if answers_open && (between_lines || !rmcp_open) => match line {
                Some(line) => output.write_all(&line).await,
                None => {
                    answers_open = false;
                    Ok(())
                }
            },
        };
        if wrote.and(output.flush().await).is_err() {
            // Nobody reads the output any more.
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncBufReadExt;

    /// Feeds `input` through the framing to an echo that answers each line rmcp would get with
    /// `got:<line>`; returns every output line.
    async fn through(input: Vec<u8>) -> Vec<String> {
        let (client, server_input) = tokio::io::duplex(PIPE_BYTES);
        let (server_output, client_reads) = tokio::io::duplex(PIPE_BYTES);
        let ((mut rmcp_reads, mut rmcp_writes), framing) = frame(server_input, server_output);
        let echo = tokio::spawn(async move {
            let mut lines = BufReader::new(&mut rmcp_reads).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = format!("{}\n", json!({"got": line}));
                rmcp_writes.write_all(reply.as_bytes()).await.expect("written");
            }
        });
        let feed = tokio::spawn(async move {
            let mut client = client;
            client.write_all(&input).await.expect("fed");
            client.shutdown().await.expect("closed");
            client
        });
        let mut out = Vec::new();
        let mut lines = BufReader::new(client_reads).lines();
        let reading = async {
            while let Ok(Some(line)) = lines.next_line().await {
                out.push(line);
            }
        };
        let finish = async {
            echo.await.expect("echo");
            framing.finish().await;
        };
        tokio::join!(reading, finish);
        drop(feed);
        out
    }

    #[tokio::test]
    async fn json_lines_pass_whole_and_the_others_are_answered_in_order() {
        let input = b"{\"a\":1}\nnot json\n\n  \r\n{\"b\":[1,2]}\r\n\xEF\xBB\xBF{\"c\":3}\n[oops\n".to_vec();
        let out = through(input).await;
        let parsed: Vec<serde_json::Value> = out.iter().map(|l| serde_json::from_str(l).expect("JSON")).collect();
        let got: Vec<&serde_json::Value> = parsed.iter().filter(|v| v.get("got").is_some()).collect();
        assert_eq!(got.len(), 3, "{out:?}");
        assert_eq!(got[0]["got"], "{\"a\":1}");
        assert_eq!(got[1]["got"], "{\"b\":[1,2]}", "as it came (the echo reads lines without their CRLF)");
        let errors: Vec<&serde_json::Value> = parsed.iter().filter(|v| v.get("error").is_some()).collect();
        assert_eq!(errors.len(), 2, "{out:?}");
        for error in errors {
            assert_eq!(error["error"]["code"], -32700);
            assert_eq!(error["id"], serde_json::Value::Null);
            assert!(error.as_object().expect("object").contains_key("id"), "id: null, present");
        }
    }

    #[tokio::test]
    async fn a_line_over_the_limit_is_answered_once_and_the_next_line_still_passes() {
        let mut input = b"{\"first\":1}\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES + 10));
        input.extend_from_slice(b"\n{\"after\":2}\n");
        let out = through(input).await;
        assert_eq!(out.len(), 3, "{:?}", out.iter().map(|l| &l[..l.len().min(80)]).collect::<Vec<_>>());
        let error: serde_json::Value = serde_json::from_str(&out[1]).expect("JSON");
        assert_eq!(error["error"]["code"], -32600, "{error}");
        assert!(out[2].contains("after"), "{}", out[2]);
        // The largest line rmcp takes passes (its newline included).
        let mut exact = vec![b'"'];
        exact.extend(std::iter::repeat_n(b'y', MAX_LINE_BYTES - 3));
        exact.extend_from_slice(b"\"\n");
        assert_eq!(exact.len(), MAX_LINE_BYTES);
        let out = through(exact).await;
        assert_eq!(out.len(), 1);
        assert!(out[0].starts_with("{\"got\""), "passed to rmcp");
    }
}
