-- tollgate usage history: take a silent gateway's checkpoint, to add it on its behalf.
--
-- KEYS[1] the registry, KEYS[2] the adoptions (see usage_orphan.lua), KEYS[3] the
--         gateway's checkpoint, KEYS[4] its checkpoint once adopted; all in {usage}
-- ARGV[1] the gateway    ARGV[2] the grace, ms
--
-- Checked again here, as another gateway may have taken it first or it may have come
-- back. A gateway silent past the grace leaves the registry (should it come back, its
-- next checkpoint learns it was adopted), and its checkpoint is moved aside and noted
-- adopted now. An adoption whose adopter went silent is taken over as it is. An
-- adoption not yet released is taken (over) before a newer checkpoint of the same
-- gateway, which waits: moving the newer one aside would overwrite it.
-- Returns the checkpoint to add, or false (nothing to add, or not for the taking).

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - tonumber(ARGV[2])
local adopted = redis.call('ZSCORE', KEYS[2], ARGV[1])
if adopted then
  if tonumber(adopted) > cutoff then
    return false
  end
else
  local seen = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if not seen or tonumber(seen) > cutoff then
    return false
  end
  redis.call('ZREM', KEYS[1], ARGV[1])
  if redis.call('EXISTS', KEYS[3]) == 0 then
    return false
  end
  redis.call('RENAME', KEYS[3], KEYS[4])
end
local held = redis.call('GET', KEYS[4])
if not held then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return false
end
redis.call('ZADD', KEYS[2], now, ARGV[1])
return held
