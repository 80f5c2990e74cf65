-- gcra.lua: the twin of crates/core/src/limit/gcra.rs, the generic cell rate algorithm (virtual
-- scheduling). A call of cost n conforms when max(TAT, now) + n*T - now <= burst*T; it then
-- moves TAT forward by n*T. Worked relative to now: `held` = how far TAT is ahead of now.
--
-- State: "gcra <tat_us> <tat_ns> <given_back_us>": the theoretical arrival time, when the key is
-- back to a full burst, as epoch microseconds plus a nanosecond remainder (a period need not be a
-- whole microsecond: 3 per second is 333333333 ns); then when it last gave back (the microsecond
-- after, GIVEN_BACK_AHEAD in crates/core/src/limit/mod.rs), or was first seen. A state written before there
-- was a third field reads as never having given back.
-- TAT moved back by `back` ns at now, never before now, stamped as a give-back.
local function gcra_move_back(state, now_us, back)
  local held = ahead_ns(now_us, state.tat_us, state.tat_ns)
  if held <= 0 then
    return state
  end
  local tat_us, tat_ns = instant(now_us, math.max(held - back, 0))
  return { tat_us = tat_us, tat_ns = tat_ns, given_back_us = math.max(now_us + 1, state.given_back_us) }
end

definitions.gcra = function()
  return {
    load = function(fields)
      if #fields ~= 2 and #fields ~= 3 then
        return nil
      end
      return { tat_us = fields[1], tat_ns = fields[2], given_back_us = fields[3] or 0 }
    end,

    save = function(state)
      return { state.tat_us, state.tat_ns, state.given_back_us }
    end,

    -- TAT at the epoch: long past, so the burst is full.
    fresh = function(_, now_us)
      return { tat_us = 0, tat_ns = 0, given_back_us = now_us }
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
          charged = { tat_us = tat_us, tat_ns = tat_ns, given_back_us = state.given_back_us }
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
      return gcra_move_back(state, now_us, math.min(units, limiter.capacity) * limiter.span)
    end,

    -- A settled price's refund: TAT moves back by what the last `units` of the charge still owe,
    -- never before now; nothing when the key gave back since the charge.
    give_back = function(limiter, state, now_us, units, taken_us, reset_after)
      local back = owed(math.min(units, limiter.capacity) * limiter.span, now_us, taken_us, reset_after)
      if state.given_back_us > taken_us or back <= 0 then
        return state
      end
      return gcra_move_back(state, now_us, back)
    end,

    forget_after = function(_, state, now_us)
      return (state.tat_us - now_us) * 1000 + state.tat_ns
    end,
  }
end
