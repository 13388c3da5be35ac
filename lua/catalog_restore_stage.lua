-- tollgate catalog restore, staging: one chunk of a gateway's copy of the catalog written
-- beside the live catalog, under the restore's own id, so that no call carries more than
-- one chunk; catalog_restore.lua then puts the staged catalog in place in one atomic step.
--
-- KEYS[1..6] the restore's staging plans, clients, keys, users, index, settings (each the
-- shape of the live key: see catalog_write.lua). All share the {catalog} hash tag, so
-- this is one Redis Cluster slot.
--
-- ARGV[1] how many seconds the staging keys are kept after this call: a gateway that
-- stops mid-restore leaves keys that expire, never a catalog.
-- ARGV[2..] per record: kind ('plan' | 'client' | 'setting'), id, the stored value
-- ("<rev> <json>", the revision kept so ETags stay valid), then for a client its plan,
-- the number of its keys n, and its n key hashes.
--
-- A chunk resent after a lost reply changes nothing: every write sets a value again, and
-- a client is counted on its plan only when it is first staged.
--
-- Returns the number of clients staged so far.

local i = 2
while i <= #ARGV do
  local kind, id, value = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if kind == 'plan' then
    redis.call('HSET', KEYS[1], id, value)
    i = i + 3
  elseif kind == 'setting' then
    redis.call('HSET', KEYS[6], id, value)
    i = i + 3
  else
    local plan, n = ARGV[i + 3], tonumber(ARGV[i + 4])
    if redis.call('HSET', KEYS[2], id, value) == 1 then
      redis.call('HINCRBY', KEYS[4], plan, 1)
    end
    redis.call('ZADD', KEYS[5], 0, id)
    for j = 1, n do redis.call('HSET', KEYS[3], ARGV[i + 4 + j], id) end
    i = i + 5 + n
  end
end
for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, ARGV[1]) end
return redis.call('HLEN', KEYS[2])
