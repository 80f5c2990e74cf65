-- fixed_window.lua: the twin of crates/core/src/limit/fixed_window.rs, a counter per window aligned to
-- multiples of the window length since the epoch.
--
-- State: "fixed_window <start_us> <start_ns> <count>": the start of the window the key last
-- counted in (epoch microseconds plus a nanosecond remainder, for windows that are not a whole
-- microsecond) and its count there.
definitions.fixed_window = function()
  return {
    load = function(fields)
      if #fields ~= 3 then
        return nil
      end
      return { start_us = fields[1], start_ns = fields[2], count = fields[3] }
    end,

    save = function(state)
      return { state.start_us, state.start_ns, state.count }
    end,

    fresh = function(limiter, now_us)
      local start_us, start_ns = instant(now_us, -window_offset(now_us, limiter.span))
      return { start_us = start_us, start_ns = start_ns, count = 0 }
    end,

    acquire = function(limiter, state, now_us, cost)
      local window = limiter.span
      local offset = window_offset(now_us, window)
      local start_us, start_ns = instant(now_us, -offset)
      local count = 0
      if state.start_us == start_us and state.start_ns == start_ns then
        count = state.count
      end
      local allowed = count + cost <= limiter.capacity
      if allowed then
        count = count + cost
      end
      local charged = nil
      if allowed and cost > 0 then
        charged = { start_us = start_us, start_ns = start_ns, count = count }
      end
      local until_end = window - offset
      return {
        allowed = allowed,
        limit = limiter.capacity,
        -- Saturating: a limit lowered under a live key must not go negative.
        remaining = math.max(limiter.capacity - count, 0),
        retry_after = allowed and 0 or until_end,
        reset_after = count == 0 and 0 or until_end,
      }, charged
    end,

    -- An operator's refund: the units taken back from the current window's count (an earlier
    -- window's count no longer counts).
    refund = function(limiter, state, now_us, units)
      local start_us, start_ns = instant(now_us, -window_offset(now_us, limiter.span))
      if state.start_us == start_us and state.start_ns == start_ns then
        return { start_us = start_us, start_ns = start_ns, count = math.max(state.count - units, 0) }
      end
      return state
    end,

    -- A settled price's refund: the units taken back from the count of the window the charge was
    -- taken in, while it is the current one; nothing once it has ended.
    give_back = function(limiter, state, now_us, units, taken_us)
      local window = limiter.span
      local start_us, start_ns = instant(now_us, -window_offset(now_us, window))
      local taken_start_us, taken_start_ns = instant(taken_us, -window_offset(taken_us, window))
      local current = state.start_us == start_us and state.start_ns == start_ns
      if current and taken_start_us == start_us and taken_start_ns == start_ns then
        return { start_us = start_us, start_ns = start_ns, count = math.max(state.count - units, 0) }
      end
      return state
    end,

    -- Forgotten when its window ends.
    forget_after = function(limiter, state, now_us)
      if state.count == 0 then
        return 0
      end
      return (state.start_us - now_us) * 1000 + state.start_ns + limiter.span
    end,
  }
end
