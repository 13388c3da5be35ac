-- tollgate usage history: add one gateway's counts for many clients' UTC days, once.
--
-- KEYS[i] = one client's day (hash), e.g. tollgate:u:{0}:acme:20261206; every key of a call
--           carries its clients' state group's tag, so a call is one Redis Cluster slot
--           fields: <limit>|<hour 00-23>|<count> with count a (admitted), r (refused),
--           c (admitted cost), u (unmetered: admitted without the store), uc (their cost);
--           ~<gateway>: the number of that gateway's last batch added here
-- ARGV[1] the gateway's id    ARGV[2] the batch's number (increasing per gateway)
-- then for each key in order: when it expires (unix s: the day's end plus the retention),
-- n, and n pairs of field, amount
--
-- A batch is resent unchanged until a reply says it was added, and a gateway's batches
-- reach a key in order, so a key whose record holds this batch's number or a later one
-- has its counts already (the reply was lost): it is skipped. Returns the keys added to.

local seen = '~' .. ARGV[1]
local seq = tonumber(ARGV[2])
local a, added = 3, 0
for _, key in ipairs(KEYS) do
  local expires, n = ARGV[a], tonumber(ARGV[a + 1])
  local first, last = a + 2, a + 1 + 2 * n
  a = last + 1
  if tonumber(redis.call('HGET', key, seen) or '0') < seq then
    for i = first, last, 2 do
      local field, amount = ARGV[i], ARGV[i + 1]
      if string.sub(field, -1) == 'c' then
        redis.call('HINCRBYFLOAT', key, field, amount)
      else
        redis.call('HINCRBY', key, field, amount)
      end
    end
    redis.call('HSET', key, seen, seq)
    redis.call('EXPIREAT', key, expires)
    added = added + 1
  end
end
return added
