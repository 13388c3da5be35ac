-- tollgate catalog apply, staging: one chunk of the writes of a `PUT /admin/v1/catalog`,
-- appended to the apply's own list beside the live catalog, so that no call carries more
-- than one chunk; catalog_apply.lua then makes them all in one atomic step.
--
-- KEYS[1] the apply's staging list (in the {catalog} slot).
-- ARGV[1] how many seconds it is kept after this call: a gateway that stops mid-apply
-- leaves a list that expires, never a catalog.
-- ARGV[2] how many writes the chunks before this one staged: a chunk resent after a lost
-- reply finds the list already longer and adds nothing.
-- ARGV[3..] the writes, each a JSON array: kind ('plan' | 'client' | 'setting'), op
-- ('put' | 'delete'), id, the record's JSON (a put), the client's plan, its key hashes.
--
-- Returns the number of writes staged so far.

if redis.call('LLEN', KEYS[1]) == tonumber(ARGV[2]) then
  for i = 3, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return redis.call('LLEN', KEYS[1])
