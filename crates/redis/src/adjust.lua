-- adjust.lua: the entry point that adjusts budgets after the fact (Limiter::adjust in Rust), each
-- as it is told: "refund" (an operator's: units given back now, never beyond the capacity),
-- "return" (a settled price below its reservation: units given back only where the call's charge
-- still counts, found by the instant it landed; the algorithm's give_back), or "charge" (a settled
-- price above it: what the key can still admit, capped at the units, taken now; a settlement
-- saturates at empty, never below). A key without state, or with another algorithm's, is as good
-- as full: a refund leaves it alone, a charge starts from a fresh state. In-flight slots are work,
-- not a price: a charge leaves them alone, a return gives them back like a refund.
--
-- A settlement is sent again when its answer is lost (a timeout, a connection dropped), and the
-- lost one may have been applied: so it carries a mark, set here with the adjustment in one
-- step, and an adjustment whose mark is already set changes nothing. Applied exactly once,
-- however often it is sent while the mark lives.
--
-- KEYS: the budgets' keys (one call's keys share a hash tag), then the mark's key when ARGV[2]
-- is above 0 (under the same hash tag).
-- ARGV[1]: now in epoch microseconds, or "" to use Redis's TIME. ARGV[2]: how long the mark lives,
-- in ms (0: no mark). ARGV[3..]: seven per budget: algorithm name, capacity, span (ns; see the
-- prelude), how ("refund", "return" or "charge"), units, and for a return the instant the charge
-- landed (epoch us, as decide.lua answered it) and its decision's reset_after (ns), else 0 0.
-- Returns each budget's level after it as decide.lua answers a cost-0 check: five integers per
-- budget, allowed (1), limit, remaining, retry_after (ns), reset_after (ns); then now (epoch us).

if redis.replicate_commands then
  redis.replicate_commands()
end

local now_us = read_now(ARGV[1])
local mark_ms = tonumber(ARGV[2]) or 0
local budgets = mark_ms > 0 and #KEYS - 1 or #KEYS
local FIRST, EACH = 3, 7
-- Every algorithm named is known before anything is written (an error reply keeps writes).
for i = 1, budgets do
  local name = ARGV[FIRST + (i - 1) * EACH]
  if not algorithms[name] then
    return redis.error_reply('unknown limiter algorithm "' .. tostring(name) .. '"')
  end
end

-- Sent before, and applied then: this time only the levels.
local again = mark_ms > 0 and not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'PX', mark_ms)

local reply = {}
for i = 1, budgets do
  local at = FIRST + (i - 1) * EACH
  local name = ARGV[at]
  local algorithm = algorithms[name]
  local limiter = { capacity = tonumber(ARGV[at + 1]), span = tonumber(ARGV[at + 2]), lease = 0, lease_us = 0 }
  local how = ARGV[at + 3]
  local units = math.min(tonumber(ARGV[at + 4]), limiter.capacity)
  local taken_us, reset_after = tonumber(ARGV[at + 5]), tonumber(ARGV[at + 6])

  local state = nil
  local raw = redis.call('GET', KEYS[i])
  if raw then
    local stored, fields = decode(raw)
    state = stored == name and algorithm.load(fields) or nil
  end
  if again then
    -- (the levels as they stand)
  elseif how == 'charge' then
    if limiter.span > 0 then
      state = state or algorithm.fresh(limiter, now_us)
      local left = algorithm.acquire(limiter, state, now_us, 0).remaining
      local _, charged = algorithm.acquire(limiter, state, now_us, math.min(units, left))
      if charged then
        state = charged
        write_state(KEYS[i], name, limiter, state, now_us)
      end
    end
  elseif state then
    if how == 'return' and algorithm.give_back then
      state = algorithm.give_back(limiter, state, now_us, units, taken_us, reset_after)
    else
      state = algorithm.refund(limiter, state, now_us, units)
    end
    write_state(KEYS[i], name, limiter, state, now_us)
  end

  local decision = algorithm.acquire(limiter, state or algorithm.fresh(limiter, now_us), now_us, 0)
  append_decision(reply, decision)
end
reply[#reply + 1] = now_us
return reply
