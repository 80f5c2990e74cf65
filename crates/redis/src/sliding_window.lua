-- sliding_window.lua: the twin of crates/core/src/limit/sliding_window.rs, the current window's count plus
-- a weighted share of the previous one: previous * (window - elapsed) / window + current.
--
-- Rust compares `previous * (window - elapsed) + (current + cost) * window` with
-- `limit * window` in u128. Both sides hold whole multiples of the window except the first
-- term, so the comparison is the same as `ceil(previous * (window - elapsed) / window) +
-- current + cost <= limit`; that ceiling (the previous window's weight, in units) is the one
-- product the script needs, and `mul_div` takes it exactly.
--
-- State: "sliding_window <start_us> <start_ns> <previous> <current>": the start of the key's
-- current window (epoch microseconds plus a nanosecond remainder) and the two counts.
local function sliding_window_weight(previous, offset, window)
  local whole, rest = mul_div(previous, window - offset, window)
  if rest > 0 then
    whole = whole + 1
  end
  return whole
end

-- The window, now's offset into it, and the previous and current counts as of now's window (a
-- count rolls into `previous` one window on, and is gone two windows on), for a refund to change.
local function rolled_to_now(limiter, state, now_us)
  local window = limiter.span
  local offset = window_offset(now_us, window)
  local previous, current = 0, 0
  local since = since_ns(now_us, state.start_us, state.start_ns, 2 * window)
  if since == offset then
    previous, current = state.previous, state.current
  elseif since == offset + window then
    previous = state.current
  end
  return window, offset, previous, current
end

definitions.sliding_window = function()
  return {
    load = function(fields)
      if #fields ~= 4 then
        return nil
      end
      return { start_us = fields[1], start_ns = fields[2], previous = fields[3], current = fields[4] }
    end,

    save = function(state)
      return { state.start_us, state.start_ns, state.previous, state.current }
    end,

    fresh = function(limiter, now_us)
      local start_us, start_ns = instant(now_us, -window_offset(now_us, limiter.span))
      return { start_us = start_us, start_ns = start_ns, previous = 0, current = 0 }
    end,

    acquire = function(limiter, state, now_us, cost)
      local window, limit = limiter.span, limiter.capacity
      local offset = window_offset(now_us, window)
      -- Roll the state forward to the window holding now.
      local previous, current = 0, 0
      local since = since_ns(now_us, state.start_us, state.start_ns, 2 * window)
      if since == offset then
        previous, current = state.previous, state.current
      elseif since == offset + window then
        previous = state.current
      end
      local weight = sliding_window_weight(previous, offset, window)
      local allowed = weight + current + cost <= limit
      if allowed then
        current = current + cost
      end
      local charged = nil
      if allowed and cost > 0 then
        local start_us, start_ns = instant(now_us, -offset)
        charged = { start_us = start_us, start_ns = start_ns, previous = previous, current = current }
      end
      local retry_after = 0
      if not allowed then
        -- When current + cost fits beside the decaying previous count: in this window, or else in
        -- the next one, where this window's count becomes the previous one.
        local older, counted, start = previous, current, -offset
        if current + cost > limit then
          older, counted, start = current, 0, window - offset
        end
        -- Rust: elapsed = window - floor(room * window / older), saturating, 0 when older is 0.
        local room = limit - counted - cost
        local elapsed = 0
        if older > 0 and room < older then
          elapsed = window - mul_div(window, room, older)
        end
        retry_after = math.max(start + elapsed, 1)
      end
      local reset_after = 0
      if current > 0 then
        reset_after = 2 * window - offset
      elseif previous > 0 then
        reset_after = window - offset
      end
      return {
        allowed = allowed,
        limit = limit,
        -- Saturating: counts kept under a larger limit may exceed this one.
        remaining = math.max(limit - current - weight, 0),
        retry_after = retry_after,
        reset_after = reset_after,
      }, charged
    end,

    -- An operator's refund: rolled to now's window like acquire, then the units taken back from
    -- the current count first, then from the previous one.
    refund = function(limiter, state, now_us, units)
      local window, offset, previous, current = rolled_to_now(limiter, state, now_us)
      local from_current = math.min(units, current)
      local start_us, start_ns = instant(now_us, -offset)
      return {
        start_us = start_us,
        start_ns = start_ns,
        previous = math.max(previous - (units - from_current), 0),
        current = current - from_current,
      }
    end,

    -- A settled price's refund: rolled to now's window like acquire, then the units taken back
    -- from the count of the window the charge was taken in: the current one, or the previous one
    -- in the window after it; nothing later.
    give_back = function(limiter, state, now_us, units, taken_us)
      local window, offset, previous, current = rolled_to_now(limiter, state, now_us)
      local taken_start_us, taken_start_ns = instant(taken_us, -window_offset(taken_us, window))
      local charged = since_ns(now_us, taken_start_us, taken_start_ns, 2 * window)
      if charged == offset then
        current = math.max(current - units, 0)
      elseif charged == offset + window then
        previous = math.max(previous - units, 0)
      end
      local start_us, start_ns = instant(now_us, -offset)
      return { start_us = start_us, start_ns = start_ns, previous = previous, current = current }
    end,

    -- Forgotten once neither of its counts weighs any more.
    forget_after = function(limiter, state, now_us)
      local start = (state.start_us - now_us) * 1000 + state.start_ns
      if state.current > 0 then
        return start + 2 * limiter.span
      elseif state.previous > 0 then
        return start + limiter.span
      end
      return 0
    end,
  }
end
