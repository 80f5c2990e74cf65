-- adaptive.lua: a learnt concurrency limit kept in one key, the twin of crates/core/src/limit/adaptive.rs,
-- so every instance of the server learns and uses one limit for the upstream account.
--
-- Floats, on purpose. The learners are arithmetic on real numbers (a limit of 5.4 slots, an
-- exponential average of round-trip times), and Lua numbers are the same IEEE doubles as Rust's
-- f64: each step below is the same operations in the same order as its Rust twin (+, -, *, /,
-- min, max and floor are exact or correctly rounded in both, and Lua's VM runs each one on its
-- own, so nothing is fused), and the state is written with 17 significant digits, which read
-- back to the very same double. So the Lua twin and the Rust one give the same limit to the last
-- bit (`learnt_limits_learn_exactly_like_their_rust_twins` in tests/limits/redis_store.rs).
-- Times are whole microseconds and counts small integers, exact as everywhere else.
--
-- A learner is named by one string: "name min max backoff_ratio tolerance smoothing long_window
-- queue_size" (the last four read by gradient2 only). Its state: "name limit cut_at_us long_rtt
-- samples"; a key kept by another learner, or holding anything else, is as good as fresh (the
-- limit at max). The key lives as long as the TTL its caller gives, refreshed at every use.

-- Each learner file adds its answer rule here: learners.<name>(learner, learnt, rtt_ns, others).
local learners = {}

local function words_of(text)
  local words = {}
  for word in string.gmatch(text, '%S+') do
    words[#words + 1] = word
  end
  return words
end

-- The learner the words from `at` on name, or nil when they do not name one.
local function read_learner(words, at)
  local learner = {
    name = words[at],
    min = tonumber(words[at + 1]),
    max = tonumber(words[at + 2]),
    backoff_ratio = tonumber(words[at + 3]),
    tolerance = tonumber(words[at + 4]),
    smoothing = tonumber(words[at + 5]),
    long_window = tonumber(words[at + 6]),
    queue_size = tonumber(words[at + 7]),
  }
  if not (learner.name and learners[learner.name] and learner.queue_size) then
    return nil
  end
  return learner
end

local function fresh_learnt(learner)
  return { limit = learner.max, cut_at_us = 0, long_rtt = 0, samples = 0 }
end

-- A real number as the state keeps it: not NaN, not infinite.
local function finite(x)
  return x ~= nil and x == x and x ~= math.huge and x ~= -math.huge
end

local function load_learnt(key, learner)
  local raw = redis.call('GET', key)
  if not raw then
    return fresh_learnt(learner)
  end
  local words = words_of(raw)
  local learnt = {
    limit = tonumber(words[2]),
    cut_at_us = tonumber(words[3]),
    long_rtt = tonumber(words[4]),
    samples = tonumber(words[5]),
  }
  if words[1] ~= learner.name or #words ~= 5 or not (finite(learnt.limit) and finite(learnt.cut_at_us)
      and finite(learnt.long_rtt) and finite(learnt.samples)) then
    return fresh_learnt(learner)
  end
  return learnt
end

local function save_learnt(key, learner, learnt, ttl_ms)
  local value = string.format('%s %.17g %.17g %.17g %.17g', learner.name, learnt.limit, learnt.cut_at_us,
    learnt.long_rtt, learnt.samples)
  redis.call('SET', key, value, 'PX', ttl_ms)
end

-- The whole slots it hands out: the limit's floor, within min and max (Learner::current).
local function learnt_current(learner, learnt)
  return math.max(learner.min, math.min(learner.max, math.floor(learnt.limit)))
end

-- An overload, whatever the learner (Learner::cut): once per round, to backoff_ratio of the
-- limit, and for a 429 (`timed_out` false) no more than the others held; a time-out with
-- nothing else running teaches nothing.
local function cut_learnt(learner, learnt, timed_out, taken_at_us, others, now_us)
  if taken_at_us < learnt.cut_at_us or (timed_out and others == 0) then
    return
  end
  local limit = learnt.limit * learner.backoff_ratio
  if not timed_out then
    limit = math.min(limit, others)
  end
  learnt.limit = limit
  learnt.cut_at_us = now_us
end

-- Within min and max, as Learner::learn leaves it.
local function clamp_learnt(learner, learnt)
  learnt.limit = math.max(learner.min, math.min(learner.max, learnt.limit))
end
