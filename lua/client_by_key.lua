-- The client an API key belongs to, in one round trip: the key index, then the record,
-- with where the catalog stands (a gateway caches the answer only if nothing it applied
-- since touched the client or the key). A gateway that does not hold the whole catalog
-- asks this when a key is not cached.
--
-- KEYS[1] keys     (hash: "sha256:<hex>" -> client id)
-- KEYS[2] clients  (hash: client id -> "<rev> <json>")
-- KEYS[3] version  (the catalog's version)
-- KEYS[4] epoch    (the catalog's identity)
-- ARGV[1] the key's hash
--
-- Returns {version or false, epoch or false, the client's "<rev> <json>" or false}.
local record = false
local id = redis.call('HGET', KEYS[1], ARGV[1])
if id then record = redis.call('HGET', KEYS[2], id) end
return {redis.call('GET', KEYS[3]), redis.call('GET', KEYS[4]), record}
