-- prelude.lua: what every limiter script shares. Exact integer arithmetic on Lua's doubles,
-- the clock, and how a key's state is written down. The scripts are assembled by
-- crates/redis/src/scripts.rs: this prelude, one file per algorithm (named after its Rust twin in
-- crates/core/src/limit/), then an entry point (decide.lua or release.lua).
--
-- Exactness. Lua numbers are doubles, which hold integers exactly up to 2^53 (about 9.007e15).
-- Epoch nanoseconds (about 1.8e18) do not fit, so:
--   * `now` is read in epoch microseconds (TIME's seconds * 10^6 + microseconds, below 2^53
--     until the year 2255);
--   * an absolute instant is kept as whole microseconds, plus a nanosecond remainder (0..999)
--     where an algorithm needs it (GCRA's TAT, a window start that is not a whole microsecond);
--   * each algorithm computes in nanoseconds *relative to now*: levels, debts, waits and
--     offsets into a window. The Rust side only sends limiters whose bucket (capacity x period)
--     and window are at most 2^52 ns (about 52 days), so the sum of two such spans is still
--     exact. Time elapsed since a key was written is clamped to the most the algorithm can use
--     before it is scaled to nanoseconds, so a long-idle key never leaves the exact range;
--   * integer division is `div` (floor, as Rust's `/` on unsigned integers), and a product that
--     could pass 2^53 (a count times a window) only ever goes through `mul_div`.

-- The algorithms, by the name the Rust side sends (`Limiter::algorithm`). Each entry has:
--   load(fields) -> state, or nil when the fields are not this algorithm's
--   save(state) -> the list of integers written after the name
--   fresh(limiter, now_us) -> the state of a key never seen
--   acquire(limiter, state, now_us, cost) -> decision, and the charged state or nil when the
--     call is refused or costs nothing (a refused call is never charged)
--   forget_after(limiter, state, now_us) -> ns from now until the state is as good as fresh
--     (0 or less: already; nil: never)
--   refund(limiter, state, now_us, units) -> the state with `units` given back, never beyond
--     the capacity (an operator's refund; adjust.lua)
--   give_back(limiter, state, now_us, units, taken_us, reset_after) -> the state with `units` of
--     a charge taken at the instant taken_us (whose decision said reset_after) given back, only
--     where that charge still counts (a settled price; adjust.lua; Algorithm::give_back in Rust)
-- `limiter` is { capacity = units, span = ns }: the span is a bucket's period (ns per unit) or
-- a window's length (0 for in-flight slots).
local algorithms = {}
-- Each algorithm file registers a constructor here instead of building its table outright: a
-- script runs from the top on every call, so only the algorithms a call names are built (the
-- seven tables of closures cost Redis about 2.6 us a call when all were built every time).
local definitions = {}
setmetatable(algorithms, {
  __index = function(all, name)
    local define = definitions[name]
    if define == nil then
      return nil
    end
    local algorithm = define()
    rawset(all, name, algorithm)
    return algorithm
  end,
})

-- floor(a / b) for integers 0 <= a < 2^53 and b > 0. A double division can land one off an
-- integer boundary, so the quotient is checked and corrected.
local function div(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- ceil(a / b) for integers 0 <= a < 2^53 and b > 0.
local function ceil_div(a, b)
  local q = div(a, b)
  if q * b < a then
    q = q + 1
  end
  return q
end

-- floor(a * b / c) and (a * b) mod c, for integers 0 <= a < 2^53 and 0 <= b <= c <= 2^52, where
-- the product itself may be far beyond 2^53: long multiplication over the bits of `a`, keeping
-- the running product as quotient and remainder, so no intermediate exceeds 2c.
local function mul_div(a, b, c)
  local bits = {}
  while a > 0 do
    local bit = a % 2
    bits[#bits + 1] = bit
    a = (a - bit) / 2
  end
  local q, r = 0, 0
  for i = #bits, 1, -1 do
    q, r = q * 2, r * 2
    if r >= c then
      q, r = q + 1, r - c
    end
    if bits[i] == 1 then
      r = r + b
      if r >= c then
        q, r = q + 1, r - c
      end
    end
  end
  return q, r
end

-- Now in epoch microseconds: the caller's reading when one is given (tests that walk time),
-- else Redis's own clock, so every server instance decides on one clock.
local function read_now(given)
  if given ~= nil and given ~= '' then
    return tonumber(given)
  end
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000000 + tonumber(time[2])
end

-- Nanoseconds from the instant `then_us` to now: 0 if that instant is not yet past, and at
-- most a little over `cap` ns (what the algorithm can use at most), so a key idle for years
-- still gives an exact integer.
local function elapsed_ns(now_us, then_us, cap)
  local us = now_us - then_us
  if us <= 0 then
    return 0
  end
  return math.min(us, div(cap, 1000) + 1) * 1000
end

-- Nanoseconds from now until the instant (us, ns); 0 if it is already past.
local function ahead_ns(now_us, us, ns)
  local whole = us - now_us
  if whole < 0 then
    return 0
  end
  return whole * 1000 + ns
end

-- Nanoseconds from the instant (us, ns) to now, when that is between 0 and `cap` ns; nil when
-- the instant is later than now or longer ago than `cap` (no algorithm looks further back).
local function since_ns(now_us, us, ns, cap)
  local whole = now_us - us
  if whole < 0 or whole > div(cap, 1000) + 1 then
    return nil
  end
  local since = whole * 1000 - ns
  if since < 0 or since > cap then
    return nil
  end
  return since
end

-- How much of `most` ns of a bucket's charge, taken at the instant `taken_us` whose decision said
-- the bucket would be full again `reset_after` ns later, is still owed now: taken + reset_after -
-- now, within 0..most (`owed` in crates/core/src/limit/mod.rs). Exact: no product leaves 2^53.
local function owed(most, now_us, taken_us, reset_after)
  local since = now_us - taken_us
  if since > div(reset_after, 1000) + 1 then
    return 0
  end
  if since < 0 and -since > div(most, 1000) + 1 then
    return most
  end
  return math.max(math.min(most, reset_after - since * 1000), 0)
end

-- The instant `offset` ns from now (negative: in the past) as whole microseconds and a
-- nanosecond remainder in 0..999.
local function instant(now_us, offset)
  local whole
  if offset >= 0 then
    whole = div(offset, 1000)
  else
    whole = -ceil_div(-offset, 1000)
  end
  return now_us + whole, offset - whole * 1000
end

-- How far now is into its window, in ns: now mod window, with windows aligned to multiples of
-- their length since the epoch (as Rust aligns them on its clock). Exact for windows up to
-- 2^52 ns: (now_us mod window) * 1000 mod window, the product taken by `mul_div`.
local function window_offset(now_us, window)
  local _, offset = mul_div(1000, now_us - div(now_us, window) * window, window)
  return offset
end

-- A key holds one string: the algorithm's name, then its state's integer fields separated by
-- spaces, e.g. "gcra 1767225600333333 333" (TAT in epoch microseconds, then nanoseconds).
-- Integers are written with %d: tostring would print only 14 significant digits.
local function encode(name, fields)
  local parts = { name }
  for i, field in ipairs(fields) do
    parts[i + 1] = string.format('%d', field)
  end
  return table.concat(parts, ' ')
end

-- The name and integer fields of a stored state; nil when a field is not an exact integer.
local function decode(raw)
  local name, fields = nil, {}
  for word in string.gmatch(raw, '%S+') do
    if name == nil then
      name = word
    else
      local field = tonumber(word)
      if field == nil or field ~= math.floor(field) or math.abs(field) > 9007199254740992 then
        return nil
      end
      fields[#fields + 1] = field
    end
  end
  return name, fields
end

-- Writes `state` of algorithm `name` under `key`, with a TTL at the moment it is as good as
-- fresh (whole milliseconds, rounded up: the key outlives its state's forget_at, never the other
-- way round), or deletes the key when that moment has passed.
local function write_state(key, name, limiter, state, now_us)
  local algorithm = algorithms[name]
  local value = encode(name, algorithm.save(state))
  local after = algorithm.forget_after(limiter, state, now_us)
  if after == nil then
    redis.call('SET', key, value)
  elseif after <= 0 then
    redis.call('DEL', key)
  else
    redis.call('SET', key, value, 'PX', math.max(ceil_div(after, 1000000), 1))
  end
end

-- Appends `decision` to `reply` as the Rust side reads a decision: allowed (1 or 0), limit,
-- remaining, retry_after (ns), reset_after (ns).
local function append_decision(reply, decision)
  reply[#reply + 1] = decision.allowed and 1 or 0
  reply[#reply + 1] = decision.limit
  reply[#reply + 1] = decision.remaining
  reply[#reply + 1] = decision.retry_after
  reply[#reply + 1] = decision.reset_after
end
