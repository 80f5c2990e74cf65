-- decide.lua: the entry point that decides every check of one call atomically, as
-- MemoryStore::decide_at does: each check is decided on the state read (or staged by an earlier
-- check on the same key), and only if ALL are allowed is every charged state written back,
-- with a TTL at the moment it is as good as fresh. Otherwise nothing is written.
--
-- First, when the call has a loop check, it is checked against the caller's recent calls
-- (loop_history.lua) in the same script, so loop detection costs no round trip of its own: a
-- loop is refused before anything is decided or charged, with the reply {-2, retry_after (us),
-- the pattern: 0 repeated, 1 an A/B oscillation, 2 no progress}; a call recorded there and then stopped by a block or refused
-- by a check is taken back out (a refused call does not count towards a loop).
--
-- A call may also be decided under a learnt limit (adaptive.lua: the upstream account's slots,
-- claimed under the limit every instance learns): the learnt limit is read in the same step, and
-- every in-flight check's capacity is scaled to it (capacity x limit / ceiling, rounded down), so
-- no instance takes a slot under a limit another has just cut. The reply then carries one more
-- integer before the clock (below): the whole slots the limit hands out.
--
-- KEYS: one per check, as given; then any operator blocks (block keys with a TTL, set through
-- the admin API): while one exists nothing is decided or charged, and the reply is
-- {-1, the block's place among them (1-based), its milliseconds left}; then the caller's loop
-- history when the call has a loop check; then, last, the learnt limit's state when it has one.
-- ARGV[1]: now in epoch microseconds, or "" to use Redis's TIME.
-- ARGV[2], ARGV[3]: the lease in-flight slots are taken under, and its duration in us
-- (see concurrency.lua).
-- ARGV[4], ARGV[5], ARGV[6]: the loop check's window (us), repeats and "<the call's signature> <its tool's>",
-- or three "" for a call without one.
-- ARGV[7]: "ceiling ttl_ms learner" (see adaptive.lua) for a call decided under a learnt limit,
-- else "".
-- ARGV[8..]: five per check: algorithm name, capacity, span (ns; see the prelude), cost, and
-- 1 for a shadow limit (its refusal does not stop the call; being refused, it charges nothing).
-- Returns five integers per check: allowed (1 or 0), limit, remaining, retry_after (ns),
-- reset_after (ns); then, last, now (epoch us): when every charge of the call landed, which a
-- settlement later gives back to (adjust.lua).

-- Redis before 5 refuses writes after TIME unless effects are replicated; later ones always do.
if redis.replicate_commands then
  redis.replicate_commands()
end

local now_us = read_now(ARGV[1])
local lease, lease_us = tonumber(ARGV[2]), tonumber(ARGV[3])

-- What a key holds: its algorithm's name and state. A missing key, or one that is not a
-- limiter state, has no name, and every check treats it as fresh.
local function read_state(key)
  local raw = redis.call('GET', key)
  if not raw then
    return {}
  end
  local name, fields = decode(raw)
  local algorithm = name and algorithms[name]
  local state = algorithm and algorithm.load(fields)
  if not state then
    return {}
  end
  return { name = name, state = state }
end

local FIRST_CHECK = 8
local checks = (#ARGV - FIRST_CHECK + 1) / 5
-- Every algorithm named is known before anything is written (an error reply keeps writes).
for i = 1, checks do
  local name = ARGV[FIRST_CHECK + (i - 1) * 5]
  if not algorithms[name] then
    return redis.error_reply('unknown limiter algorithm "' .. tostring(name) .. '"')
  end
end

-- The learnt limit the call is decided under, if any: its key, ceiling and current slots.
local under = nil
if ARGV[7] ~= '' then
  local words = words_of(ARGV[7])
  local learner = read_learner(words, 3)
  if not learner then
    return redis.error_reply('unknown learner "' .. ARGV[7] .. '"')
  end
  under = { key = KEYS[#KEYS], ceiling = tonumber(words[1]), ttl_ms = tonumber(words[2]) }
  under.current = learnt_current(learner, load_learnt(under.key, learner))
end
local after_history = under and 1 or 0

local loop_window, loop_repeats = tonumber(ARGV[4]), tonumber(ARGV[5])
local history = loop_window and KEYS[#KEYS - after_history]
local recorded = nil
if history then
  local answer = loop_history(history, now_us, 'check', loop_window, loop_repeats, ARGV[6])
  if answer[1] == 0 then
    return { -2, answer[2], answer[3] }
  end
  recorded = answer[2]
end
-- The call is refused after all: it does not count towards a loop.
local function take_back()
  if recorded then
    loop_history(history, now_us, 'forget', loop_window, loop_repeats, recorded)
  end
end

local last_block = #KEYS - after_history - (history and 1 or 0)
for b = checks + 1, last_block do
  local left = redis.call('PTTL', KEYS[b])
  if left > 0 then
    take_back()
    return { -1, b - checks, left }
  end
end

local staged = {}
local order = {}
local reply = {}
local all_allowed = true
for i = 1, checks do
  local key = KEYS[i]
  local at = FIRST_CHECK + (i - 1) * 5
  local name = ARGV[at]
  local algorithm = algorithms[name]
  local limiter = {
    capacity = tonumber(ARGV[at + 1]),
    span = tonumber(ARGV[at + 2]),
    lease = lease,
    lease_us = lease_us,
  }
  local cost = tonumber(ARGV[at + 3])
  local shadow = ARGV[at + 4] == '1'
  if under and name == 'concurrency' then
    limiter.capacity = div(limiter.capacity * under.current, under.ceiling)
  end

  local entry = staged[key]
  if not entry then
    entry = read_state(key)
    staged[key] = entry
    order[#order + 1] = key
  end
  -- State kept by another algorithm (a config change) is treated as fresh, as in Rust.
  local state = entry.state
  if entry.name ~= name then
    state = algorithm.fresh(limiter, now_us)
  end

  local decision, charged = algorithm.acquire(limiter, state, now_us, cost)
  entry.name, entry.state, entry.limiter = name, charged or state, limiter
  if charged then
    entry.charged = true
  end
  all_allowed = all_allowed and (decision.allowed or shadow)
  append_decision(reply, decision)
end

if all_allowed then
  for _, key in ipairs(order) do
    local entry = staged[key]
    if entry.charged then
      write_state(key, entry.name, entry.limiter, entry.state, now_us)
    end
  end
else
  take_back()
end

if under then
  redis.call('PEXPIRE', under.key, under.ttl_ms)
  reply[#reply + 1] = under.current
end
reply[#reply + 1] = now_us
return reply
