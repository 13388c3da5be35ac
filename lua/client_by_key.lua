-- The client an API key belongs to, in one round trip: the key index, then the record.
-- A gateway that does not hold the whole catalog asks this when a key is not cached.
--
-- KEYS[1] keys     (hash: "sha256:<hex>" -> client id)
-- KEYS[2] clients  (hash: client id -> "<rev> <json>")
-- ARGV[1] the key's hash
--
-- Returns the client's "<rev> <json>", or false: no client has the key.
local id = redis.call('HGET', KEYS[1], ARGV[1])
if not id then return false end
return redis.call('HGET', KEYS[2], id)
