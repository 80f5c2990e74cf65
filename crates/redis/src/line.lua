-- line.lua: the entry point of the one line every instance's waiting jobs stand in, so that the
-- account's next free slot goes to the job whose turn it is, on whichever instance it waits (the
-- twin of State::pick in src/upstream/queue/round_robin.rs, over all instances).
--
-- Order. A job joins with a tag, its flow's virtual finish time (start-time fair queueing, the
-- twin of the local deficit round robin): start = max(the line's virtual time, its flow's last
-- tag), tag = start + 1 / its flow's weight; serving a job moves the virtual time to its tag. A
-- flow with fifty jobs waiting holds fifty growing tags, so another flow's single job, tagged at
-- the virtual time, goes next but one. Among the jobs that may go now (their instance alive,
-- their class's gap passed, the unverified callers' share not taken), one of a tier holding fewer
-- slots than it is reserved goes first, then the highest rank, each by tag.
--
-- A claim names its instance: if the job whose turn it is waits there, its slots are taken in the
-- same step (the account's, the share's for an unverified caller, its tier's, its class's gap)
-- and it leaves the line; otherwise nothing changes, and the instance waits to hear a slot freed
-- (release.lua says so) or asks again a second later. A claim may bring a candidate that has not
-- joined (a job at the door): it goes at once only if it would be next. Every claim and join
-- marks its instance alive for ALIVE_US; a job of an instance not marked alive (nor in the grace
-- a mark that ran out is given: mark_alive) is dropped from the line, so a dead instance's jobs
-- never hold the line.
--
-- KEYS: 1 the line (a sorted set: member -> tag), 2 the flows (a hash: flow -> "count tail"),
-- 3 the line's virtual time (a string), 4 the instances alive (a sorted set: instance ->
-- until, epoch us; "~" and an instance -> the end of its grace), 5 each member's flow (a hash); for a claim, then: 6 the account's slots,
-- 7 the unverified callers' share, 8 the learnt limit (read only with a learner), then one key
-- per class with a gap, then one per tier.
-- ARGV[1]: the operation (join, leave, alive, claim). ARGV[2]: the instance. ARGV[3]: how long a
-- mark of being alive lasts (us).
--   alive: marks the instance alive (its heartbeat, while it has jobs in the line).
--   join: ARGV[4] the member, ARGV[5] its flow, ARGV[6] its weight, ARGV[7] its tag, "" for a
--     new one behind its flow's, or "front" for the line's virtual time (a job put back keeps its
--     place), ARGV[8] the name it had in the line when it joins again, or "". Returns its tag (a
--     string) and its name in the line.
--   leave: ARGV[4] the member. Returns 1 if it was in the line.
--   claim: ARGV[4] the lease, ARGV[5] its duration (us), ARGV[6] the account's capacity,
--     ARGV[7] the share's, ARGV[8] "ceiling ttl_ms learner" or "", ARGV[9] the most entries
--     read, ARGV[10] the number of classes C, then C gap specs ("key capacity span": its key's
--     place among the gap keys, the GCRA's burst and period; "" for a class without a gap), then
--     the number of tiers T, then T reserved shares, then a candidate member or "" and its flow
--     and weight, then the channel a freed slot is told on: a claim that lets a job go and
--     leaves slots free while jobs wait says so there, for the instance whose job is next.
--     Returns {1, job, now_us, learnt limit or -1, dropped} when one of this instance's jobs
--     goes, else {0, why (1 the account is full, 2 another instance's job is next, 3 nothing may
--     go), ns until something may go by time alone or -1, 1 if the whole line was read, dropped,
--     then per job of this instance in the line: its id and how many go before it}; `dropped` is
--     the jobs of instances no longer alive this claim took out of the line, as one string of
--     ids separated by spaces, for the claiming instance to end.
--
-- A member is "instance \31 job \31 class \31 unverified \31 tier \31 rank": the class and tier
-- as 1-based indices into the keys above (tier 0: none), unverified 1 or 0. In the line it is
-- named after the order it joined in ("sequence \31 member", the sequence zero-padded), so that
-- of two jobs with the same tag the one that joined first goes first.

if redis.replicate_commands then
  redis.replicate_commands()
end

local now_us = read_now('')
local op, instance, alive_us = ARGV[1], ARGV[2], tonumber(ARGV[3])
local LINE, FLOWS, VTIME, ALIVE, FLOW_OF = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
-- Keys left with nobody in line go away by themselves.
local IDLE_MS = 86400000

-- An entry of the line (named with its sequence) or a candidate (not).
local function parse(member, in_line)
  local f = {}
  for field in string.gmatch(member, '[^\31]+') do
    f[#f + 1] = field
  end
  local at = in_line and 1 or 0
  return {
    member = member,
    instance = f[at + 1],
    job = f[at + 2],
    class = tonumber(f[at + 3]),
    unverified = f[at + 4] == '1',
    tier = tonumber(f[at + 5]),
    rank = tonumber(f[at + 6]),
  }
end

-- An instance whose mark ran out is given one more mark's life from the moment a call notices, a
-- grace (kept as "~" and its name: instances are named in hex), before its jobs are dropped: after
-- Redis was away longer than a mark lasts, every mark has run out at once, and the instances alive
-- say so again within a heartbeat of its return, before their jobs (some of them sent to the
-- upstream while Redis was away) are taken for a dead instance's. An instance silent through its
-- grace too is dead.
local GRACE = '~'
local function mark_alive()
  local graced = {}
  for _, who in ipairs(redis.call('ZRANGEBYSCORE', ALIVE, '-inf', now_us)) do
    if string.sub(who, 1, 1) ~= GRACE and not redis.call('ZSCORE', ALIVE, GRACE .. who) then
      graced[#graced + 1] = who
    end
  end
  redis.call('ZREMRANGEBYSCORE', ALIVE, '-inf', now_us)
  for _, who in ipairs(graced) do
    redis.call('ZADD', ALIVE, now_us + alive_us, GRACE .. who)
  end
  redis.call('ZADD', ALIVE, now_us + alive_us, instance)
  redis.call('ZREM', ALIVE, GRACE .. instance)
  redis.call('PEXPIRE', ALIVE, IDLE_MS)
end

local function vtime()
  return tonumber(redis.call('GET', VTIME) or '0') or 0
end

-- The flow's waiting count and its last tag.
local function flow_of(flow)
  local raw = redis.call('HGET', FLOWS, flow)
  if not raw then
    return 0, 0
  end
  local count, tail = string.match(raw, '^(%S+) (%S+)$')
  return tonumber(count) or 0, tonumber(tail) or 0
end

local function set_flow(flow, count, tail)
  if count <= 0 then
    redis.call('HDEL', FLOWS, flow)
  else
    redis.call('HSET', FLOWS, flow, string.format('%d %.17g', count, tail))
  end
end

-- The tag a new job of `flow` (of weight `weight`) would have.
local function next_tag(flow, weight)
  local _, tail = flow_of(flow)
  return math.max(vtime(), tail) + 1 / weight
end

-- Takes `member` (of `flow`, if known) out of the line; whether it was in it.
local function take_out(member, flow)
  if redis.call('ZREM', LINE, member) == 0 then
    return false
  end
  if flow then
    local count, tail = flow_of(flow)
    set_flow(flow, count - 1, tail)
  end
  return true
end

local function touch()
  for _, key in ipairs({ LINE, FLOWS, VTIME, FLOW_OF }) do
    redis.call('PEXPIRE', key, IDLE_MS)
  end
end

if op == 'join' then
  local member, flow, weight, tag = ARGV[4], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
  if ARGV[7] == 'front' then
    tag = vtime()
  end
  mark_alive()
  if ARGV[8] ~= '' then
    member = ARGV[8]
    local held = redis.call('ZSCORE', LINE, member)
    if held then
      return { held, member }
    end
  else
    -- Never a member's name: members start with their sequence's digits.
    local sequence = redis.call('HINCRBY', FLOW_OF, '~sequence', 1)
    member = string.format('%015d', sequence) .. '\31' .. member
  end
  if not tag then
    tag = next_tag(flow, weight)
  end
  local count, tail = flow_of(flow)
  set_flow(flow, count + 1, math.max(tail, tag))
  redis.call('ZADD', LINE, string.format('%.17g', tag), member)
  redis.call('HSET', FLOW_OF, member, flow)
  touch()
  return { string.format('%.17g', tag), member }
end

if op == 'leave' then
  local member = ARGV[4]
  local flow = redis.call('HGET', FLOW_OF, member)
  redis.call('HDEL', FLOW_OF, member)
  if take_out(member, flow) then
    return 1
  end
  return 0
end

if op == 'alive' then
  mark_alive()
  return 1
end

if op ~= 'claim' then
  return redis.error_reply('unknown line operation "' .. tostring(op) .. '"')
end

mark_alive()
local lease, lease_us = tonumber(ARGV[4]), tonumber(ARGV[5])
local cap, share = tonumber(ARGV[6]), tonumber(ARGV[7])
local scan = tonumber(ARGV[9])
local at = 10
local classes = tonumber(ARGV[at])
local gap_specs = {}
local gap_keys = 0
for c = 1, classes do
  gap_specs[c] = ARGV[at + c]
  if gap_specs[c] ~= '' then
    gap_keys = gap_keys + 1
  end
end
at = at + classes + 1
local tiers = tonumber(ARGV[at])
local shares = {}
for t = 1, tiers do
  shares[t] = tonumber(ARGV[at + t])
end
at = at + tiers + 1
local candidate = ARGV[at] ~= '' and parse(ARGV[at], false) or nil
local candidate_flow, candidate_weight = ARGV[at + 1], tonumber(ARGV[at + 2])
local told = ARGV[at + 3]

-- The learnt limit, as decide.lua reads it: the account's and the share's capacities scaled to it.
local current = -1
if ARGV[8] ~= '' then
  local words = words_of(ARGV[8])
  local learner = read_learner(words, 3)
  if not learner then
    return redis.error_reply('unknown learner "' .. ARGV[8] .. '"')
  end
  local ceiling = tonumber(words[1])
  current = learnt_current(learner, load_learnt(KEYS[8], learner))
  cap, share = div(cap * current, ceiling), div(share * current, ceiling)
  redis.call('PEXPIRE', KEYS[8], tonumber(words[2]))
end

local ACCOUNT, SHARE = KEYS[6], KEYS[7]
local function tier_key(tier)
  return KEYS[8 + gap_keys + tier]
end

local in_use = units_of(live_leases(load_leases(ACCOUNT), now_us))
local share_in_use = units_of(live_leases(load_leases(SHARE), now_us))
local tier_in_use, reserved = {}, {}
for t = 1, tiers do
  tier_in_use[t] = units_of(live_leases(load_leases(tier_key(t)), now_us))
  -- As TierRule::share_of: rounded down, a whole share the whole.
  reserved[t] = shares[t] >= 1 and cap or math.floor(cap * math.max(shares[t], 0))
end

-- A class's gap as a GCRA of burst 1: its limiter, its state, and how long until it passes.
local gaps = {}
local function gap_of(class)
  if gaps[class] == nil then
    local spec = gap_specs[class]
    if not spec or spec == '' then
      gaps[class] = false
    else
      local words = words_of(spec)
      local key = KEYS[8 + tonumber(words[1])]
      local limiter = { capacity = tonumber(words[2]), span = tonumber(words[3]) }
      local raw = redis.call('GET', key)
      local state = nil
      if raw then
        local name, fields = decode(raw)
        state = name == 'gcra' and algorithms.gcra.load(fields)
      end
      state = state or algorithms.gcra.fresh(limiter, now_us)
      local decision = algorithms.gcra.acquire(limiter, state, now_us, 1)
      gaps[class] = { key = key, limiter = limiter, state = state, wait = decision.allowed and 0 or decision.retry_after }
    end
  end
  return gaps[class]
end

local alive = {}
local function is_alive(who)
  if alive[who] == nil then
    local until_us = tonumber(redis.call('ZSCORE', ALIVE, who) or '0') or 0
    local grace_us = tonumber(redis.call('ZSCORE', ALIVE, GRACE .. who) or '0') or 0
    alive[who] = math.max(until_us, grace_us) > now_us
  end
  return alive[who]
end

-- How long until `entry` may go by time alone (0: now; nil: only when a slot is given back).
local function wait_of(entry)
  if entry.unverified and share_in_use >= share then
    return nil
  end
  local gap = gap_of(entry.class)
  return gap and gap.wait or 0
end

local function owed(entry)
  return entry.tier > 0 and not entry.unverified and tier_in_use[entry.tier] < reserved[entry.tier]
end

-- Reads the line in tag order, dropping the jobs of instances no longer alive; the first job
-- owed a slot that may go, and the first of the highest rank that may go.
local entries = redis.call('ZRANGE', LINE, 0, scan - 1, 'WITHSCORES')
local dropped = {}
local line = {}
local first_owed, first_ranked = nil, nil
local wake = nil
local function consider(entry)
  local wait = wait_of(entry)
  if wait == 0 then
    if owed(entry) and not first_owed then
      first_owed = entry
    end
    if not first_ranked or entry.rank > first_ranked.rank then
      first_ranked = entry
    end
  elseif wait then
    wake = wake and math.min(wake, wait) or wait
  end
end
local candidate_tag = candidate and next_tag(candidate_flow, candidate_weight)
for i = 1, #entries, 2 do
  local entry = parse(entries[i], true)
  entry.tag = tonumber(entries[i + 1])
  if candidate and not candidate.seen and candidate_tag < entry.tag then
    candidate.tag, candidate.seen = candidate_tag, true
    consider(candidate)
  end
  if is_alive(entry.instance) then
    line[#line + 1] = entry
    consider(entry)
  else
    local flow = redis.call('HGET', FLOW_OF, entry.member)
    redis.call('HDEL', FLOW_OF, entry.member)
    take_out(entry.member, flow)
    dropped[#dropped + 1] = entry.job
  end
end
if candidate and not candidate.seen then
  candidate.tag, candidate.seen = candidate_tag, true
  consider(candidate)
end

local next_up = first_owed or first_ranked
local why = nil
if in_use >= cap then
  why = 1
elseif not next_up then
  why = 3
elseif next_up.instance ~= instance then
  why = 2
end

if why then
  -- How many go before each of this instance's jobs (what `queue_position` shows), as State::pick
  -- orders them: every job that goes first (a tier owed a slot, then a higher rank), and those
  -- alike with an earlier place in the line.
  local function precedence(entry)
    return (owed(entry) and 1 or 0), entry.rank
  end
  local function before(a_owed, a_rank, b_owed, b_rank)
    return a_owed > b_owed or (a_owed == b_owed and a_rank > b_rank)
  end
  local groups = {}
  for _, entry in ipairs(line) do
    local o, r = precedence(entry)
    local key = o .. ' ' .. r
    local group = groups[key]
    if not group then
      group = { owed = o, rank = r, count = 0, seen = 0 }
      groups[key] = group
    end
    group.count = group.count + 1
  end
  local complete = redis.call('ZCARD', LINE) <= scan and 1 or 0
  local reply = { 0, why, wake or -1, complete, table.concat(dropped, ' ') }
  for _, entry in ipairs(line) do
    local o, r = precedence(entry)
    local mine = groups[o .. ' ' .. r]
    if entry.instance == instance then
      local ahead = mine.seen
      for _, group in pairs(groups) do
        if before(group.owed, group.rank, o, r) then
          ahead = ahead + group.count
        end
      end
      reply[#reply + 1] = entry.job
      reply[#reply + 1] = ahead
    end
    mine.seen = mine.seen + 1
  end
  return reply
end

-- One of ours goes: its slots, in one step (all are free: checked above).
local function take_slot(key, capacity)
  local limiter = { capacity = capacity, span = 0, lease = lease, lease_us = lease_us }
  local _, charged = algorithms.concurrency.acquire(limiter, load_leases(key), now_us, 1)
  if charged then
    write_state(key, 'concurrency', limiter, charged, now_us)
  end
end
take_slot(ACCOUNT, cap)
if next_up.unverified then
  take_slot(SHARE, math.max(share, 1))
end
if next_up.tier > 0 then
  take_slot(tier_key(next_up.tier), math.max(cap, 1))
end
local gap = gap_of(next_up.class)
if gap then
  local _, charged = algorithms.gcra.acquire(gap.limiter, gap.state, now_us, 1)
  if charged then
    write_state(gap.key, 'gcra', gap.limiter, charged, now_us)
  end
end
if next_up ~= candidate then
  local flow = redis.call('HGET', FLOW_OF, next_up.member)
  redis.call('HDEL', FLOW_OF, next_up.member)
  take_out(next_up.member, flow)
else
  -- A job served at the door moves its flow on as one that waited would have.
  local count, tail = flow_of(candidate_flow)
  if count > 0 then
    set_flow(candidate_flow, count, math.max(tail, candidate.tag))
  end
end
redis.call('SET', VTIME, string.format('%.17g', math.max(vtime(), next_up.tag)), 'PX', IDLE_MS)
-- Slots left free and jobs still waiting: the instance whose job is next may be asleep (several
-- slots freed at once were one message), so it is told.
if told and told ~= '' and in_use + 1 < cap and redis.call('ZCARD', LINE) > 0 then
  redis.call('PUBLISH', told, 'turn')
end
return { 1, next_up.job, now_us, current, table.concat(dropped, ' ') }
