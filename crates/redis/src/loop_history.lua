-- loop_history.lua: the twin of crates/core/src/guard/loops/, a caller's recent calls kept in Redis so
-- that every instance sees the same history: a stuck agent repeating one call round-robin over
-- three instances is stopped on its 5th call, not its 15th. decide.lua checks a call here in
-- the same script as its budgets, so loop detection costs no round trip of its own; an answer is
-- heard here (loop_answer.lua) once the call has one.
--
-- The rules are those of loops/: the same signature `repeats` times in a row within the
-- window, or the `repeats`-th occurrence of a signature in a strict A/B/A/B alternation, is
-- refused and stops that signature (both, for an alternation) until `window` has passed; the
-- same answer from one tool `no_progress` times in a row stops the tool (its tool signature)
-- likewise; a stopped signature is refused with the time left and not recorded. An answer other
-- than the last one its signature got makes the earlier calls of that signature stop counting
-- (they become '-', which matches nothing). At most 2 x repeats calls, 32 stops and 32 tools'
-- streaks are kept; the key expires a window after its last write.
--
-- State: MessagePack (Redis's cmsgpack, in C: a third of the time the words below took to read and
-- write), five values: the tag "h1", the next seq, then three flat arrays: the calls
-- (<seq> <signature> <at_us> <answer> ...), the stops (<signature> <until_us> <pattern> ...) and
-- the tools' streaks (<tool signature> <answer> <same> <at_us> ...), calls and streaks oldest
-- first, an answer not yet heard '-', pattern 0 (repeated), 1 (oscillating) or 2 (no progress).
-- Integers are packed as integers, exact to 2^53 (unlike cjson's 14 digits). A state in words, as
-- the version before wrote it ("<next seq> c <seq> <signature> <at_us> <answer> ... p <signature>
-- <until_us> <pattern> ... s <tool signature> <answer> <same> <at_us> ..."), is still read, so
-- instances of both versions share one history while a deployment rolls (the older one reads
-- this one's as empty). Anything else unreadable is an empty history.
local MAX_STOPS = 32
local MAX_STREAKS = 32

-- The fields of a call, a stop and a streak, in the order the packed state keeps them.
local CALL, STOP, STREAK = { 's', 'g', 't', 'a' }, { 'g', 'u', 'o' }, { 'g', 'a', 'n', 't' }

-- `list` as one flat array of each item's `fields`, in order. (Counted, not `#out + 1`: the
-- length operator searches, and this runs on every call and answer.)
local function flat(list, fields)
  local out, k, width = {}, 0, #fields
  for _, item in ipairs(list) do
    for f = 1, width do
      k = k + 1
      out[k] = item[fields[f]]
    end
  end
  return out
end

-- `flat` read back: the items of `fields` (three or four) in `array`, each field of the type
-- `kinds` names; nil if the array is not that. Each item is made whole by one constructor, which
-- sizes it once (filled a field at a time, a table is resized as it grows: this was half of what
-- reading a history cost Redis).
local function items(array, fields, kinds)
  local width, out, k = #fields, {}, 0
  if #array % width ~= 0 then
    return nil
  end
  local f1, f2, f3, f4 = fields[1], fields[2], fields[3], fields[4]
  for i = 1, #array, width do
    for f = 1, width do
      if type(array[i + f - 1]) ~= kinds[f] then
        return nil
      end
    end
    k = k + 1
    if f4 then
      out[k] = { [f1] = array[i], [f2] = array[i + 1], [f3] = array[i + 2], [f4] = array[i + 3] }
    else
      out[k] = { [f1] = array[i], [f2] = array[i + 1], [f3] = array[i + 2] }
    end
  end
  return out
end

-- The history under `key` at `now_us`, `window` (us) and `repeats`:
-- * mode "check": `arg` is "<signature> <tool signature>", the answer {1, seq} (recorded) or
--   {0, retry_after_us, pattern};
-- * mode "forget": `arg` is the seq to take back, the answer {1};
-- * mode "answer": `arg` is "<signature> <tool signature> <answer> <no_progress>", the answer
--   {same, stopped_for_us}: identical answers of the tool in a row (1 when no_progress is 0) and,
--   when this one stopped the tool, for how long (else 0).
local function loop_history(key, now_us, mode, window, repeats, arg)
  -- Reads a history written in words (the version before); anything unreadable is an empty one.
  local function load_words(raw)
    local state = { n = 0, c = {}, p = {}, s = {} }
    local words = {}
    for word in string.gmatch(raw, '%S+') do
      words[#words + 1] = word
    end
    state.n = tonumber(words[1]) or 0
    local i = 2
    while i <= #words do
      if words[i] == 'c' and i + 4 <= #words then
        state.c[#state.c + 1] = { s = tonumber(words[i + 1]), g = words[i + 2], t = tonumber(words[i + 3]), a = words[i + 4] }
        i = i + 5
      elseif words[i] == 'p' and i + 3 <= #words then
        state.p[#state.p + 1] = { g = words[i + 1], u = tonumber(words[i + 2]), o = tonumber(words[i + 3]) }
        i = i + 4
      elseif words[i] == 's' and i + 4 <= #words then
        state.s[#state.s + 1] = { g = words[i + 1], a = words[i + 2], n = tonumber(words[i + 3]), t = tonumber(words[i + 4]) }
        i = i + 5
      else
        return { n = state.n, c = {}, p = {}, s = {} }
      end
    end
    return state
  end

  -- Reads the history; anything unreadable is an empty one.
  local function load(raw)
    local empty = { n = 0, c = {}, p = {}, s = {} }
    if not raw then
      return empty
    end
    if string.find(raw, '^%d') then
      return load_words(raw)
    end
    local ok, tag, n, calls, stops, streaks = pcall(cmsgpack.unpack, raw)
    if not ok or tag ~= 'h1' or type(n) ~= 'number' or type(calls) ~= 'table' or type(stops) ~= 'table'
      or type(streaks) ~= 'table' then
      return empty
    end
    local c = items(calls, CALL, { 'number', 'string', 'number', 'string' })
    local p = items(stops, STOP, { 'string', 'number', 'number' })
    local st = items(streaks, STREAK, { 'string', 'string', 'number', 'number' })
    if not c or not p or not st then
      return empty
    end
    return { n = n, c = c, p = p, s = st }
  end

  local state = load(redis.call('GET', key))

  local function save()
    if #state.c == 0 and #state.p == 0 and #state.s == 0 then
      redis.call('DEL', key)
      return
    end
    local calls, stops, streaks = flat(state.c, CALL), flat(state.p, STOP), flat(state.s, STREAK)
    local packed = cmsgpack.pack('h1', state.n, calls, stops, streaks)
    redis.call('SET', key, packed, 'PX', math.max(ceil_div(window, 1000), 1))
  end

  -- The items of `list` for which `wanted` holds, in order.
  local function kept(list, wanted)
    local out = {}
    for _, item in ipairs(list) do
      if wanted(item) then
        out[#out + 1] = item
      end
    end
    return out
  end

  local function stop(sig, pattern)
    state.p = kept(state.p, function(s) return s.g ~= sig end)
    if #state.p >= MAX_STOPS then
      local soonest = 1
      for i, s in ipairs(state.p) do
        if s.u < state.p[soonest].u then
          soonest = i
        end
      end
      table.remove(state.p, soonest)
    end
    state.p[#state.p + 1] = { g = sig, u = now_us + window, o = pattern }
  end

  if mode == 'forget' then
    local seq = tonumber(arg)
    state.c = kept(state.c, function(call) return call.s ~= seq end)
    save()
    return { 1 }
  end

  if mode == 'answer' then
    local signature, tool, answer, no_progress = string.match(arg, '^(%S+) (%S+) (%S+) (%d+)$')
    no_progress = tonumber(no_progress) or 0
    -- The latest call of the signature still waiting for its answer gets it; if the one before
    -- it got another answer, the earlier calls stop counting.
    local this = nil
    for i = #state.c, 1, -1 do
      if state.c[i].g == signature and state.c[i].a == '-' then
        this = i
        break
      end
    end
    if this then
      local changed = false
      for i = this - 1, 1, -1 do
        if state.c[i].g == signature and state.c[i].a ~= '-' then
          changed = state.c[i].a ~= answer
          break
        end
      end
      if changed then
        for i = 1, this - 1 do
          if state.c[i].g == signature then
            state.c[i].g = '-'
          end
        end
      end
      state.c[this].a = answer
    end
    local same, stopped_for = 1, 0
    if no_progress >= 2 then
      local streaks, found = {}, nil
      for _, streak in ipairs(state.s) do
        if now_us - streak.t < window then
          streaks[#streaks + 1] = streak
          if streak.g == tool then
            found = streak
          end
        end
      end
      state.s = streaks
      if found then
        if found.a == answer then
          found.n = found.n + 1
        else
          found.n = 1
        end
        found.a, found.t = answer, now_us
        same = found.n
      else
        if #state.s >= MAX_STREAKS then
          table.remove(state.s, 1)
        end
        state.s[#state.s + 1] = { g = tool, a = answer, n = 1, t = now_us }
      end
      if same >= no_progress then
        stop(tool, 2)
        stopped_for = window
      end
    end
    save()
    return { same, stopped_for }
  end

  local signature, tool = string.match(arg, '^(%S+) (%S+)$')

  state.p = kept(state.p, function(stop) return stop.u > now_us end)
  for _, stop in ipairs(state.p) do
    if stop.g == signature or stop.g == tool then
      return { 0, stop.u - now_us, stop.o }
    end
  end

  -- A call stamped a hair after now (another instance read the clock later) is live.
  local calls = kept(state.c, function(call) return now_us - call.t < window end)
  state.c = calls

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

  if #calls >= 1 and calls[#calls].g ~= signature and calls[#calls].g ~= '-' then
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
  calls[#calls + 1] = { s = seq, g = signature, t = now_us, a = '-' }
  state.n = seq + 1
  save()
  return { 1, seq }
end
