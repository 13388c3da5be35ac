-- tollgate usage history: add one gateway's counts for one client and one UTC day, once.
--
-- KEYS[1] = the client's day (hash), e.g. tollgate:u:{acme}:20261206
--           fields: <limit>|<hour 00-23>|<count> with count a (admitted), r (refused),
--           c (admitted cost), u (unmetered: admitted without the store), uc (their cost);
--           ~<gateway>: the last batch of that gateway added here
-- ARGV[1] the gateway's id    ARGV[2] the batch's number (increasing per gateway)
-- ARGV[3] when the day's record expires (unix s: the day's end plus the retention)
-- ARGV[4..] field, amount, field, amount, ...
--
-- A batch is resent unchanged until a reply says it was added, and a gateway's batches
-- reach a key in order, so a batch numbered at or below the last one added here was
-- added already (its reply was lost): it adds nothing. Returns 1 if added, 0 if not.

local key, seen = KEYS[1], '~' .. ARGV[1]
local seq = tonumber(ARGV[2])
local last = tonumber(redis.call('HGET', key, seen) or '0')
if last >= seq then
  return 0
end
for i = 4, #ARGV, 2 do
  local field, amount = ARGV[i], ARGV[i + 1]
  if string.sub(field, -1) == 'c' then
    redis.call('HINCRBYFLOAT', key, field, amount)
  else
    redis.call('HINCRBY', key, field, amount)
  end
end
redis.call('HSET', key, seen, seq)
redis.call('EXPIREAT', key, ARGV[3])
return 1
