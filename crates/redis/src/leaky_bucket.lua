-- leaky_bucket.lua: the twin of crates/core/src/limit/leaky_bucket.rs, a leaky bucket as a meter: each call
-- pours its cost in, the bucket drains one unit every `period` ns, and a call that would
-- overflow it is refused.
--
-- State: "leaky_bucket <water> <updated_us>": how full the bucket was (ns of draining) when
-- last written, and when that was in epoch microseconds (a `now`; for a give-back or a refund,
-- the microsecond after it, as the token bucket).
-- `back` ns of water out at now, never below empty, stamped as a give-back.
local function leaky_bucket_take_out(state, now_us, back)
  local water = math.max(state.water - elapsed_ns(now_us, state.updated_us, state.water), 0)
  return { water = math.max(water - back, 0), updated_us = math.max(now_us + 1, state.updated_us) }
end

definitions.leaky_bucket = function()
  return {
    load = function(fields)
      if #fields ~= 2 then
        return nil
      end
      return { water = fields[1], updated_us = fields[2] }
    end,

    save = function(state)
      return { state.water, state.updated_us }
    end,

    fresh = function(_, now_us)
      return { water = 0, updated_us = now_us }
    end,

    acquire = function(limiter, state, now_us, cost)
      local period = limiter.span
      local brim = limiter.capacity * period
      local water = math.max(state.water - elapsed_ns(now_us, state.updated_us, state.water), 0)
      local poured = water + cost * period
      local allowed = poured <= brim
      if allowed then
        water = poured
      end
      local charged = nil
      if allowed and cost > 0 then
        charged = { water = water, updated_us = math.max(now_us, state.updated_us) }
      end
      return {
        allowed = allowed,
        limit = limiter.capacity,
        -- Saturating: water poured under a larger brim may stand above this one (as in Rust,
        -- the wait is then still exact: until the water is down to the brim less this cost).
        remaining = div(math.max(brim - water, 0), period),
        retry_after = allowed and 0 or poured - brim,
        reset_after = water,
      }, charged
    end,

    -- An operator's refund: the units' water taken out, never below empty.
    refund = function(limiter, state, now_us, units)
      return leaky_bucket_take_out(state, now_us, math.min(units, limiter.capacity) * limiter.span)
    end,

    -- A settled price's refund: the water the last `units` of the charge have not drained yet;
    -- nothing when the key was written since the charge.
    give_back = function(limiter, state, now_us, units, taken_us, reset_after)
      local back = owed(math.min(units, limiter.capacity) * limiter.span, now_us, taken_us, reset_after)
      if state.updated_us > taken_us or back <= 0 then
        return state
      end
      return leaky_bucket_take_out(state, now_us, back)
    end,

    -- Forgotten once it has drained.
    forget_after = function(_, state, now_us)
      return (state.updated_us - now_us) * 1000 + state.water
    end,
  }
end
