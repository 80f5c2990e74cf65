-- wrk driver for the refusal run: one fixed POST, built once, so wrk itself is not the limit.
wrk.method = "POST"
wrk.path = "/mcp"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Accept"] = "application/json, text/event-stream"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("TOKEN") or "load-test")
wrk.body = '{"jsonrpc":"2.0","id":1,"method":"ping"}'

done = dofile("scripts/load/report.lua")
