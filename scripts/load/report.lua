-- The summary line scripts/load.sh parses; each driver does `done = dofile("scripts/load/report.lua")`.
return function(summary, latency, requests)
  io.write(string.format("RESULT rps=%.0f p50_us=%d p99_us=%d requests=%d non_2xx=%d errors=%d\n",
    summary.requests / (summary.duration / 1e6), latency:percentile(50), latency:percentile(99),
    summary.requests, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
