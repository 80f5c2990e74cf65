-- wrk driver: POSTs MCP tools/call requests, rotating through pre-opened sessions.
-- SESSIONS (comma-separated Mcp-Session-Id values) and TOKEN come from the environment;
-- scripts/load.sh opens the sessions with curl before starting wrk. TOOL names the tool
-- (default rate_limit_status). ARGUMENTS is its arguments, a JSON object (default {}), or
-- several separated by '|', sent in turn: e.g. pages of list_articles (scripts/bench-compare.sh),
-- so loop detection, which refuses the same call repeated, never refuses a tool it does not exempt.
local sessions = {}
for id in string.gmatch(os.getenv("SESSIONS") or "", "[^,]+") do
  sessions[#sessions + 1] = id
end
if #sessions == 0 then
  sessions[1] = "none" -- the refusal run: every POST is refused before a session is looked up
end
local arguments = {}
for args in string.gmatch(os.getenv("ARGUMENTS") or "{}", "[^|]+") do
  arguments[#arguments + 1] = args
end
local token = os.getenv("TOKEN") or "load-test"
local tool = os.getenv("TOOL") or "rate_limit_status"
local n = 0

request = function()
  n = n + 1
  local headers = {
    ["Content-Type"] = "application/json",
    ["Accept"] = "application/json, text/event-stream",
    ["Authorization"] = "Bearer " .. token,
    ["MCP-Protocol-Version"] = "2025-11-25",
    ["Mcp-Session-Id"] = sessions[(n % #sessions) + 1],
  }
  local body = string.format(
    '{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"%s","arguments":%s}}',
    n, tool, arguments[(n % #arguments) + 1])
  return wrk.format("POST", "/mcp", headers, body)
end

done = dofile("scripts/load/report.lua")
