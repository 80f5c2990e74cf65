-- loop_history.lua: the twin of crates/core/src/guard/loops.rs, a caller's recent calls kept in Redis so
-- that every instance sees the same history: a stuck agent repeating one call round-robin over
-- three instances is stopped on its 5th call, not its 15th. decide.lua checks a call here in
-- the same script as its budgets, so loop detection costs no round trip of its own.
--
-- The rules are those of loops.rs: the same signature `repeats` times in a row within the
-- window, or the `repeats`-th occurrence of a signature in a strict A/B/A/B alternation, is
-- refused and stops that signature (both, for an alternation) until `window` has passed; a
-- stopped signature is refused with the time left and not recorded. At most 2 x repeats calls
-- and 32 stops are kept; the key expires a window after its last write.
--
-- State: "<next seq> c <seq> <signature> <at_us> ... p <signature> <until_us> <oscillating> ...",
-- calls oldest first; integers written with %d (exact, unlike cjson's 14 digits).
local MAX_STOPS = 32

-- The history under `key` at `now_us`, `window` (us) and `repeats`: for mode "check", `arg` is
-- the call's signature, and the answer {1, seq} (recorded) or {0, retry_after_us, oscillating};
-- for mode "forget", `arg` is the seq to take back, and the answer {1}.
local function loop_history(key, now_us, mode, window, repeats, arg)
  -- Reads the history; anything unreadable is an empty one.
  local function load(raw)
    local state = { n = 0, c = {}, p = {} }
    if not raw then
      return state
    end
    local words = {}
    for word in string.gmatch(raw, '%S+') do
      words[#words + 1] = word
    end
    state.n = tonumber(words[1]) or 0
    local i = 2
    while i <= #words do
      if words[i] == 'c' and i + 3 <= #words then
        state.c[#state.c + 1] = { s = tonumber(words[i + 1]), g = words[i + 2], t = tonumber(words[i + 3]) }
        i = i + 4
      elseif words[i] == 'p' and i + 3 <= #words then
        state.p[#state.p + 1] = { g = words[i + 1], u = tonumber(words[i + 2]), o = tonumber(words[i + 3]) }
        i = i + 4
      else
        return { n = state.n, c = {}, p = {} }
      end
    end
    return state
  end

  local state = load(redis.call('GET', key))

  local function save()
    if #state.c == 0 and #state.p == 0 then
      redis.call('DEL', key)
      return
    end
    local parts = { string.format('%d', state.n) }
    for _, call in ipairs(state.c) do
      parts[#parts + 1] = string.format('c %d %s %d', call.s, call.g, call.t)
    end
    for _, stop in ipairs(state.p) do
      parts[#parts + 1] = string.format('p %s %d %d', stop.g, stop.u, stop.o)
    end
    redis.call('SET', key, table.concat(parts, ' '), 'PX', math.max(ceil_div(window, 1000), 1))
  end

  if mode == 'forget' then
    local seq = tonumber(arg)
    local kept = {}
    for _, call in ipairs(state.c) do
      if call.s ~= seq then
        kept[#kept + 1] = call
      end
    end
    state.c = kept
    save()
    return { 1 }
  end

  local signature = arg

  local stops = {}
  for _, stop in ipairs(state.p) do
    if stop.u > now_us then
      stops[#stops + 1] = stop
    end
  end
  state.p = stops
  for _, stop in ipairs(stops) do
    if stop.g == signature then
      return { 0, stop.u - now_us, stop.o }
    end
  end

  local calls = {}
  for _, call in ipairs(state.c) do
    -- A call stamped a hair after now (another instance read the clock later) is live.
    if now_us - call.t < window then
      calls[#calls + 1] = call
    end
  end
  state.c = calls

  local function stop(sig, oscillating)
    if #state.p >= MAX_STOPS then
      local soonest = 1
      for i, s in ipairs(state.p) do
        if s.u < state.p[soonest].u then
          soonest = i
        end
      end
      table.remove(state.p, soonest)
    end
    state.p[#state.p + 1] = { g = sig, u = now_us + window, o = oscillating }
  end

  local same = 1
  for i = #calls, 1, -1 do
    if calls[i].g ~= signature then
      break
    end
    same = same + 1
  end
  if same >= repeats then
    stop(signature, 0)
    save()
    return { 0, window, 0 }
  end

  if #calls >= 1 and calls[#calls].g ~= signature then
    local other = calls[#calls].g
    local alternating, expect, i = 2, signature, #calls - 1
    while i >= 1 and calls[i].g == expect do
      alternating = alternating + 1
      expect = (expect == signature) and other or signature
      i = i - 1
    end
    if ceil_div(alternating, 2) >= repeats then
      stop(signature, 1)
      stop(other, 1)
      save()
      return { 0, window, 1 }
    end
  end

  if #calls >= 2 * repeats then
    table.remove(calls, 1)
  end
  local seq = state.n
  calls[#calls + 1] = { s = seq, g = signature, t = now_us }
  state.n = seq + 1
  save()
  return { 1, seq }
end
