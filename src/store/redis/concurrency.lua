-- concurrency.lua: the twin of src/limit/concurrency.rs, a fixed number of in-flight slots.
-- No clock: a slot is taken when a call is admitted and given back by release.lua when the
-- work ends, so a refusal's retry_after is 0.
--
-- State: "concurrency <in_flight>". The key has no TTL while slots are held (a held slot is
-- never forgotten) and is deleted when the last one is given back.
algorithms.concurrency = {
  load = function(fields)
    if #fields ~= 1 then
      return nil
    end
    return { in_flight = fields[1] }
  end,

  save = function(state)
    return { state.in_flight }
  end,

  fresh = function()
    return { in_flight = 0 }
  end,

  acquire = function(limiter, state, _, cost)
    local in_flight = state.in_flight
    local allowed = in_flight + cost <= limiter.capacity
    if allowed then
      in_flight = in_flight + cost
    end
    local charged = nil
    if allowed and cost > 0 then
      charged = { in_flight = in_flight }
    end
    return {
      allowed = allowed,
      limit = limiter.capacity,
      -- Saturating: a cap lowered under held slots must not go negative.
      remaining = math.max(limiter.capacity - in_flight, 0),
      retry_after = 0,
      reset_after = 0,
    }, charged
  end,

  forget_after = function(_, state)
    if state.in_flight == 0 then
      return 0
    end
    return nil
  end,

  -- The state with `cost` slots given back.
  release = function(state, cost)
    return { in_flight = math.max(state.in_flight - cost, 0) }
  end,
}
