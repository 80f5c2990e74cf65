-- token_bucket.lua: the twin of crates/core/src/limit/token_bucket.rs, a token bucket with lazy refill and
-- costs. The level is kept in ns of refill (one token = `period` ns), so refill is elapsed
-- time and every wait is exact.
--
-- State: "token_bucket <level> <updated_us>": the level (ns of refill) when last written, and
-- when that was in epoch microseconds (a `now`; for a give-back or a refund, the microsecond
-- after it: GIVEN_BACK_AHEAD in crates/core/src/limit/mod.rs).
-- `back` ns of refill into the level at now, never past full, stamped as a give-back.
local function token_bucket_put_back(limiter, state, now_us, back)
  local full = limiter.capacity * limiter.span
  local level = math.min(state.level + elapsed_ns(now_us, state.updated_us, full), full)
  return { level = math.min(level + back, full), updated_us = math.max(now_us + 1, state.updated_us) }
end

definitions.token_bucket = function()
  return {
    load = function(fields)
      if #fields ~= 2 then
        return nil
      end
      return { level = fields[1], updated_us = fields[2] }
    end,

    save = function(state)
      return { state.level, state.updated_us }
    end,

    fresh = function(limiter, now_us)
      return { level = limiter.capacity * limiter.span, updated_us = now_us }
    end,

    acquire = function(limiter, state, now_us, cost)
      local period = limiter.span
      local full = limiter.capacity * period
      local level = math.min(state.level + elapsed_ns(now_us, state.updated_us, full), full)
      local need = cost * period
      local allowed = need <= level
      if allowed then
        level = level - need
      end
      local charged = nil
      if allowed and cost > 0 then
        charged = { level = level, updated_us = math.max(now_us, state.updated_us) }
      end
      return {
        allowed = allowed,
        limit = limiter.capacity,
        remaining = div(level, period),
        retry_after = allowed and 0 or need - level,
        reset_after = full - level,
      }, charged
    end,

    -- An operator's refund: the level brought to now, plus the units, never beyond full.
    refund = function(limiter, state, now_us, units)
      return token_bucket_put_back(limiter, state, now_us, math.min(units, limiter.capacity) * limiter.span)
    end,

    -- A settled price's refund: the refill the last `units` of the charge still owe, back into
    -- the level, never past full; nothing when the key was written since the charge.
    give_back = function(limiter, state, now_us, units, taken_us, reset_after)
      local back = owed(math.min(units, limiter.capacity) * limiter.span, now_us, taken_us, reset_after)
      if state.updated_us > taken_us or back <= 0 then
        return state
      end
      return token_bucket_put_back(limiter, state, now_us, back)
    end,

    -- Full again once the missing level has refilled.
    forget_after = function(limiter, state, now_us)
      return (state.updated_us - now_us) * 1000 + limiter.capacity * limiter.span - state.level
    end,
  }
end
