-- record.lua: writes a record every instance reads (a job's snapshot), unless the one already
-- there must stand: a final record is never replaced, and a record is never replaced by an older
-- version of itself (a write delayed on a broken connection, landing after a newer one).
--
-- Records are JSON objects; this reads three of their fields: `final` (true once the record will
-- not change), `version` (a count its writer raises with each write) and `unsettled` (true on a
-- final record another instance wrote for its owner, which may then replace it with a final one
-- of its own, its price settled: a webhook's job). A record without them (written by an older
-- server) is not final and has version 0; a value that is not a JSON object is replaced.
--
-- KEYS[1]: the record. ARGV[1]: the new record; ARGV[2]: its version; ARGV[3]: its lifetime (ms).
-- Returns 1 when written, 0 when the record there stood.
local old = redis.call('GET', KEYS[1])
if old then
  local readable, record = pcall(cjson.decode, old)
  if readable and type(record) == 'table' then
    if record['final'] == true then
      if record['unsettled'] ~= true then
        return 0
      end
      local new_readable, new = pcall(cjson.decode, ARGV[1])
      if not (new_readable and type(new) == 'table' and new['final'] == true) then
        return 0
      end
    end
    local version = tonumber(record['version']) or 0
    if version > tonumber(ARGV[2]) then
      return 0
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
