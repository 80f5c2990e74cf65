-- adaptive/aimd.lua: the twin of crates/core/src/limit/adaptive/aimd.rs. An answer grows the limit by
-- 1/limit while at least half of it is in use.
learners.aimd = function(_, learnt, _, others)
  if (others + 1) * 2 >= learnt.limit then
    learnt.limit = learnt.limit + 1 / math.max(learnt.limit, 1)
  end
end
