-- tollgate key filter, keys given: sets the bits of key hashes an apply is about to link
-- (key_filter.lua, before this, has filter_add), before its commit. A key is never taken
-- out of the filter, so bits set for an apply that is then refused cost a store read for
-- those keys, never a refusal.
--
-- KEYS[1] the key filter, KEYS[2] its meta. ARGV[1..] key hashes ("sha256:<64 hex>").

for i = 1, #ARGV do filter_add(KEYS[1], KEYS[2], ARGV[i]) end
return #ARGV
