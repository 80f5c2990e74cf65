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
--
-- The three arrays are worked on as they are unpacked, flat, an item a run of fields (a call's at
-- base b: b + 1 its seq, b + 2 its signature, b + 3 its instant, b + 4 its answer): no table is
-- made for an item, and what is dropped is dropped in place (a table an item, made on every read
-- and flattened again on every write, was most of what a history cost Redis).
local MAX_STOPS = 32
local MAX_STREAKS = 32

-- Each item's width in its array, and the type of each of its fields.
local CALL_KINDS = { 'number', 'string', 'number', 'string' }
local STOP_KINDS = { 'string', 'number', 'number' }
local STREAK_KINDS = { 'string', 'string', 'number', 'number' }
local CALL, STOP, STREAK = #CALL_KINDS, #STOP_KINDS, #STREAK_KINDS

-- Whether `array` is whole items whose fields are of the types `kinds` names.
local function whole(array, kinds)
  local width, length = #kinds, #array
  if length % width ~= 0 then
    return false
  end
  for i = 1, length, width do
    for f = 1, width do
      if type(array[i + f - 1]) ~= kinds[f] then
        return false
      end
    end
  end
  return true
end

-- Keeps, in place and in order, the items (each `width` fields) of `array` for which
-- `wanted(array, base)` holds, `base` the index before the item's first field; their count.
local function keep(array, width, wanted)
  local length, kept = #array, 0
  for base = 0, length - width, width do
    if wanted(array, base) then
      if kept ~= base then
        for f = 1, width do
          array[kept + f] = array[base + f]
        end
      end
      kept = kept + width
    end
  end
  for i = length, kept + 1, -1 do
    array[i] = nil
  end
  return kept / width
end

-- Takes out the item of `width` fields at `base` (the others closing up behind it).
local function take_out(array, width, base)
  local length = #array
  for i = base + 1, length - width do
    array[i] = array[i + width]
  end
  for i = length, length - width + 1, -1 do
    array[i] = nil
  end
end

-- Reads a history written in words (the version before): its next seq and its three arrays;
-- anything unreadable is an empty one.
local function load_words(raw)
  local words = {}
  for word in string.gmatch(raw, '%S+') do
    words[#words + 1] = word
  end
  local n = tonumber(words[1]) or 0
  local calls, stops, streaks = {}, {}, {}
  local i, count = 2, #words
  while i <= count do
    local mark, k = words[i], nil
    if mark == 'c' and i + 4 <= count then
      k = #calls
      calls[k + 1], calls[k + 2], calls[k + 3], calls[k + 4] =
        tonumber(words[i + 1]), words[i + 2], tonumber(words[i + 3]), words[i + 4]
      i = i + 5
    elseif mark == 'p' and i + 3 <= count then
      k = #stops
      stops[k + 1], stops[k + 2], stops[k + 3] = words[i + 1], tonumber(words[i + 2]), tonumber(words[i + 3])
      i = i + 4
    elseif mark == 's' and i + 4 <= count then
      k = #streaks
      streaks[k + 1], streaks[k + 2], streaks[k + 3], streaks[k + 4] =
        words[i + 1], words[i + 2], tonumber(words[i + 3]), tonumber(words[i + 4])
      i = i + 5
    else
      return n, {}, {}, {}
    end
  end
  if not whole(calls, CALL_KINDS) or not whole(stops, STOP_KINDS) or not whole(streaks, STREAK_KINDS) then
    return n, {}, {}, {}
  end
  return n, calls, stops, streaks
end

-- Reads the history: its next seq and its three arrays; anything unreadable is an empty one.
local function load(raw)
  if not raw then
    return 0, {}, {}, {}
  end
  if string.find(raw, '^%d') then
    return load_words(raw)
  end
  local ok, tag, n, calls, stops, streaks = pcall(cmsgpack.unpack, raw)
  if not ok or tag ~= 'h1' or type(n) ~= 'number' or type(calls) ~= 'table' or type(stops) ~= 'table'
    or type(streaks) ~= 'table' then
    return 0, {}, {}, {}
  end
  if not whole(calls, CALL_KINDS) or not whole(stops, STOP_KINDS) or not whole(streaks, STREAK_KINDS) then
    return 0, {}, {}, {}
  end
  return n, calls, stops, streaks
end

-- The history under `key` at `now_us`, `window` (us) and `repeats`:
-- * mode "check": `arg` is "<signature> <tool signature>", the answer {1, seq} (recorded) or
--   {0, retry_after_us, pattern};
-- * mode "forget": `arg` is the seq to take back, the answer {1};
-- * mode "answer": `arg` is "<signature> <tool signature> <answer> <no_progress>", the answer
--   {same, stopped_for_us}: identical answers of the tool in a row (1 when no_progress is 0) and,
--   when this one stopped the tool, for how long (else 0).
local function loop_history(key, now_us, mode, window, repeats, arg)
  local n, calls, stops, streaks = load(redis.call('GET', key))

  local function save()
    if #calls == 0 and #stops == 0 and #streaks == 0 then
      redis.call('DEL', key)
      return
    end
    redis.call('SET', key, cmsgpack.pack('h1', n, calls, stops, streaks), 'PX', math.max(ceil_div(window, 1000), 1))
  end

  -- Stops `sig` for a window with `pattern`: in place of its stop, if it had one; the stop that
  -- ends soonest makes room when MAX_STOPS are kept.
  local function stop(sig, pattern)
    local count = keep(stops, STOP, function(a, base) return a[base + 1] ~= sig end)
    if count >= MAX_STOPS then
      local soonest = 0
      for base = STOP, #stops - STOP, STOP do
        if stops[base + 2] < stops[soonest + 2] then
          soonest = base
        end
      end
      take_out(stops, STOP, soonest)
    end
    local k = #stops
    stops[k + 1], stops[k + 2], stops[k + 3] = sig, now_us + window, pattern
  end

  if mode == 'forget' then
    local seq = tonumber(arg)
    keep(calls, CALL, function(a, base) return a[base + 1] ~= seq end)
    save()
    return { 1 }
  end

  if mode == 'answer' then
    local signature, tool, answer, no_progress = string.match(arg, '^(%S+) (%S+) (%S+) (%d+)$')
    no_progress = tonumber(no_progress) or 0
    -- The latest call of the signature still waiting for its answer gets it; if the one before
    -- it got another answer, the earlier calls stop counting.
    local this = nil
    for base = #calls - CALL, 0, -CALL do
      if calls[base + 2] == signature and calls[base + 4] == '-' then
        this = base
        break
      end
    end
    if this then
      local changed = false
      for base = this - CALL, 0, -CALL do
        if calls[base + 2] == signature and calls[base + 4] ~= '-' then
          changed = calls[base + 4] ~= answer
          break
        end
      end
      if changed then
        for base = 0, this - CALL, CALL do
          if calls[base + 2] == signature then
            calls[base + 2] = '-'
          end
        end
      end
      calls[this + 4] = answer
    end
    local same, stopped_for = 1, 0
    if no_progress >= 2 then
      keep(streaks, STREAK, function(a, base) return now_us - a[base + 4] < window end)
      local found = nil
      for base = 0, #streaks - STREAK, STREAK do
        if streaks[base + 1] == tool then
          found = base
        end
      end
      if found then
        if streaks[found + 2] == answer then
          streaks[found + 3] = streaks[found + 3] + 1
        else
          streaks[found + 3] = 1
        end
        streaks[found + 2], streaks[found + 4] = answer, now_us
        same = streaks[found + 3]
      else
        if #streaks >= MAX_STREAKS * STREAK then
          take_out(streaks, STREAK, 0)
        end
        local k = #streaks
        streaks[k + 1], streaks[k + 2], streaks[k + 3], streaks[k + 4] = tool, answer, 1, now_us
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

  keep(stops, STOP, function(a, base) return a[base + 2] > now_us end)
  for base = 0, #stops - STOP, STOP do
    if stops[base + 1] == signature or stops[base + 1] == tool then
      return { 0, stops[base + 2] - now_us, stops[base + 3] }
    end
  end

  -- A call stamped a hair after now (another instance read the clock later) is live.
  local count = keep(calls, CALL, function(a, base) return now_us - a[base + 3] < window end)

  local same = 1
  for base = #calls - CALL, 0, -CALL do
    if calls[base + 2] ~= signature then
      break
    end
    same = same + 1
  end
  if same >= repeats then
    stop(signature, 0)
    save()
    return { 0, window, 0 }
  end

  local last = #calls - CALL
  if count >= 1 and calls[last + 2] ~= signature and calls[last + 2] ~= '-' then
    local other = calls[last + 2]
    local alternating, expect, base = 2, signature, last - CALL
    while base >= 0 and calls[base + 2] == expect do
      alternating = alternating + 1
      expect = (expect == signature) and other or signature
      base = base - CALL
    end
    if ceil_div(alternating, 2) >= repeats then
      stop(signature, 1)
      stop(other, 1)
      save()
      return { 0, window, 1 }
    end
  end

  if count >= 2 * repeats then
    take_out(calls, CALL, 0)
  end
  local seq = n
  local k = #calls
  calls[k + 1], calls[k + 2], calls[k + 3], calls[k + 4] = seq, signature, now_us, '-'
  n = seq + 1
  save()
  return { 1, seq }
end
