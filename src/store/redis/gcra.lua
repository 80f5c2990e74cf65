-- gcra.lua: the twin of src/limit/gcra.rs, the generic cell rate algorithm (virtual
-- scheduling). A call of cost n conforms when max(TAT, now) + n*T - now <= burst*T; it then
-- moves TAT forward by n*T. Worked relative to now: `held` = how far TAT is ahead of now.
--
-- State: "gcra <tat_us> <tat_ns>": the theoretical arrival time, when the key is back to a
-- full burst, as epoch microseconds plus a nanosecond remainder (a period need not be a whole
-- microsecond: 3 per second is 333333333 ns).
definitions.gcra = function()
  return {
    load = function(fields)
      if #fields ~= 2 then
        return nil
      end
      return { tat_us = fields[1], tat_ns = fields[2] }
    end,

    save = function(state)
      return { state.tat_us, state.tat_ns }
    end,

    -- TAT at the epoch: long past, so the burst is full.
    fresh = function()
      return { tat_us = 0, tat_ns = 0 }
    end,

    acquire = function(limiter, state, now_us, cost)
      local period = limiter.span
      local tolerance = limiter.capacity * period
      local held = ahead_ns(now_us, state.tat_us, state.tat_ns)
      local debt = held + cost * period
      if debt <= tolerance then
        local charged = nil
        if cost > 0 then
          local tat_us, tat_ns = instant(now_us, debt)
          charged = { tat_us = tat_us, tat_ns = tat_ns }
        end
        return {
          allowed = true,
          limit = limiter.capacity,
          remaining = div(tolerance - debt, period),
          retry_after = 0,
          reset_after = debt,
        }, charged
      end
      return {
        allowed = false,
        limit = limiter.capacity,
        -- Saturating: a TAT booked under a larger burst may be further ahead than this one's.
        remaining = div(math.max(tolerance - held, 0), period),
        retry_after = debt - tolerance,
        reset_after = held,
      }, nil
    end,

    -- An operator's refund: TAT moves back by the units' periods, never before now (full).
    refund = function(limiter, state, now_us, units)
      local held = ahead_ns(now_us, state.tat_us, state.tat_ns)
      if held <= 0 then
        return state
      end
      local back = math.min(units, limiter.capacity) * limiter.span
      local tat_us, tat_ns = instant(now_us, math.max(held - back, 0))
      return { tat_us = tat_us, tat_ns = tat_ns }
    end,

    forget_after = function(_, state, now_us)
      return (state.tat_us - now_us) * 1000 + state.tat_ns
    end,
  }
end
