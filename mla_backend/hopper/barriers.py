"""Named barrier ids of the SM90 decode kernels (0 is the CTA's `bar.sync 0`; ids go up to 15)."""

# ping-pong (16-row blocks): warpgroup wg synchronises with itself on barrier PINGPONG_WG + wg
PINGPONG_WG = 1

# S^T-warpgroup schedule (decode_swg.py)
PV_BAR = 1  # warpgroups 0 and 1 (256 threads): P(ci) and alpha(ci) written
S_FULL = 2  # + buffer (2, 3): S^T(j) stored and its chunk landed; the S^T warpgroup arrives, 0 and 1 wait
S_FREE = 4  # + buffer (4, 5): S^T(j) read and the V^T registers of chunk j loaded; 0 and 1 arrive, the S^T wg waits
LOAD_BAR = 6  # the S^T warpgroup alone: every copy of a chunk landed
SWG_ALPHA_BAR = 7  # warpgroups 0 and 1 (`early_rescale`, research): alpha(ci) written, P.V(ci - 1) done in both

# chunk-pairs schedule (decode_pairs.py)
PAIR_MAX_BAR = 1  # warpgroups 0 and 1 (256 threads): each one's chunk maxima of the rows written
PAIR_P_BAR = 2  # warpgroups 0 and 1: P of both chunks and each warpgroup's alphas written
PAIR_Q_BAR = 3  # the load warpgroup arrives once Q landed, warpgroups 0 and 1 wait (384 threads)
PAIR_SUM_BAR = 4  # warpgroups 0 and 1 at a segment's end: warpgroup 1's row sums, then the output scales, written
PAIR_WG_BAR = 5  # + warpgroup (5, 6): one MMA warpgroup alone, the zeroed tail of its chunk written
PAIR_PV_DONE_BAR = 7  # warpgroups 0 and 1 (`p_after_pv`): P.V of the pair before done in both, its P buffers free
PAIR_TAIL_BAR = 8  # warpgroups 0 and 1 (`vt_smem`): the zeroed tail of a segment's last chunk written, before both
# warpgroups transpose that pair's chunks
# chunk pairs a phase apart (decode_pairs_stagger.py), warpgroups 0 (the leader) and 1 (the follower), 256 threads,
# each arrived at by one warpgroup and waited on by the other once a pair
STAGGER_S_BAR = 9  # the leader's S done: the follower issues its own
STAGGER_MAX_BAR = 10  # the leader's new maxima and alphas written
STAGGER_P0_BAR = 11  # the leader's P written
STAGGER_P1_BAR = 12  # the follower's P, maxima, betas and flag written
STAGGER_P0_FREE_BAR = 13  # the follower's P.V of the leader's chunk done: the leader's P buffer may be rewritten
