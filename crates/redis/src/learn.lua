-- learn.lua: the entry point that teaches a learnt limit (adaptive.lua) what one slot's use
-- said, atomically: instances learning at once never lose a sample, and every one of them reads
-- the limit that results. Also reads the limit alone (an empty signal), refreshing its TTL.
--
-- KEYS[1]: the learner's state. KEYS[2]: the in-flight slots it limits (concurrency.lua).
-- ARGV[1]: now in epoch microseconds, or "" to use Redis's TIME.
-- ARGV[2]: how long the state is kept past this use (ms).
-- ARGV[3]: the learner (see adaptive.lua).
-- ARGV[4]: "1" the upstream took the work, "0" it said it had too much (a 429), "2" it did not
-- answer in time, "" only read.
-- ARGV[5]: the slot's round-trip time (ns). ARGV[6]: when the slot was taken (us, this clock).
-- ARGV[7]: the slots in use besides it, or "" to count the live leases on KEYS[2] but its own.
-- Returns {the whole slots it hands out, the limit (17 significant digits), now (us)}.

-- Redis before 5 refuses writes after TIME unless effects are replicated; later ones always do.
if redis.replicate_commands then
  redis.replicate_commands()
end

local now_us = read_now(ARGV[1])
local ttl_ms = tonumber(ARGV[2])
local learner = read_learner(words_of(ARGV[3]), 1)
if not learner then
  return redis.error_reply('unknown learner "' .. tostring(ARGV[3]) .. '"')
end
local learnt = load_learnt(KEYS[1], learner)
if ARGV[4] == '' then
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
else
  local others = tonumber(ARGV[7])
  if not others then
    others = math.max(units_of(live_leases(load_leases(KEYS[2]), now_us)) - 1, 0)
  end
  if ARGV[4] == '0' or ARGV[4] == '2' then
    cut_learnt(learner, learnt, ARGV[4] == '2', tonumber(ARGV[6]), others, now_us)
  else
    learners[learner.name](learner, learnt, tonumber(ARGV[5]), others)
  end
  clamp_learnt(learner, learnt)
  save_learnt(KEYS[1], learner, learnt, ttl_ms)
end
return { learnt_current(learner, learnt), string.format('%.17g', learnt.limit), now_us }
