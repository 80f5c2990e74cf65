-- wrk driver for the refusal run: one fixed POST, built once, so wrk itself is not the limit.
wrk.method = "POST"
wrk.path = "/mcp"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Accept"] = "application/json, text/event-stream"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("TOKEN") or "load-test")
wrk.body = '{"jsonrpc":"2.0","id":1,"method":"ping"}'

done = function(summary, latency, requests)
  io.write(string.format("RESULT rps=%.0f p50_us=%d p99_us=%d requests=%d non_2xx=%d errors=%d\n",
    summary.requests / (summary.duration / 1e6), latency:percentile(50), latency:percentile(99),
    summary.requests, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
