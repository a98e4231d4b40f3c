/* The tags of a collective's messages on the algorithms' channel. Bits 0-3: the algorithm's own tag.
 * Bits 4-14: a hash of what every rank must agree on (the collective, dtype, reduce op and root),
 * never 0. Bits 15-30: the call's number in the group, modulo 2**16. A transport with only 15 bits of
 * tag (MPI promises tags up to 32767; Open MPI has 31 bits) folds the number into the hash instead.
 *
 * So a message of another call is never taken for this one's. On a wide transport (TCP, shared
 * memory, Open MPI) a rank can also tell, from a message nobody has taken yet, that its sender is in
 * another collective: the same call number with another hash, or an earlier call's message that was
 * never taken (a peer ahead sends a later number, which is not an error). */
#ifndef ENGINE_CALL_TAGS_H
#define ENGINE_CALL_TAGS_H

#include <stdint.h>

#define ENG_CALL_ALGO_BITS 4

static inline int eng_call_tag_base(uint64_t call_hash, uint64_t seq, int wide) {
  uint64_t h = call_hash ^ (wide ? 0 : seq * 0x9E3779B97F4A7C15ULL);
  h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ULL;   /* splitmix64's finalizer */
  h = (h ^ (h >> 27)) * 0x94D049BB133111EBULL;
  h ^= h >> 31;
  int base = (int)(1 + h % 2047) << ENG_CALL_ALGO_BITS;
  return wide ? base | (int)((seq & 0xFFFF) << 15) : base;
}

/* Whether a message with tag `tag`, which no receive took, shows its sender in another collective
 * than the running call (tag base `running`; 0 where no call runs: the signature exchange). */
static inline int eng_other_call(int running, int tag) {
  uint32_t mine = (uint32_t)running, theirs = (uint32_t)tag & ~((1u << ENG_CALL_ALGO_BITS) - 1);
  if (mine == 0 || theirs == 0 || tag < 0) return 0;
  uint32_t ahead = ((theirs >> 15) - (mine >> 15)) & 0xFFFF;
  if (ahead == 0) return theirs != mine;
  return ahead >= 0x8000;
}

#endif
