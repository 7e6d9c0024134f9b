/*
 * Promela model of the signal protocol of csrc/common/protocol.h, checked
 * with Spin by tests/test_protocol_model.py. tests/model/README.md says what
 * is modelled, how it maps to the C++ names and what is abstracted away.
 *
 * KEEP IN STEP WITH csrc/common/protocol.h: a change to the protocol there
 * (flag stores, barriers, epochs used per call, staging or descriptor
 * parity, the descriptor check, the mismatch recovery) changes this model in
 * the same commit, and the test must then still pass for the model and fail
 * for every mutant.
 *
 * One process per (rank r, block b): W ranks x NB blocks, NCALLS consecutive
 * calls each. Each call's kind is chosen nondeterministically, the same on
 * every rank (under -DMISMATCH rank W-1's call MIS_CALL differs). Memory is
 * sequentially consistent: release/acquire is not modelled (the TSan rung
 * covers it). A buffer is one tag byte per chunk: whose data it holds.
 *
 * Options (-D on the spin command line):
 *   W=2|3 ranks, NB blocks per rank (default 1: README, "Blocks"), NCALLS
 *   calls per block (default 4);
 *   STAGED_ONLY: only staged calls (all the host backend runs); WITH_AGREE:
 *   agreement-only calls (kAgreeOnly) among the correct calls too;
 *   E0=n: initial epoch n, E0_WIDE / E0_ALL: any of 0,1,127,128,254,255 /
 *   0..255 (default: 254 or 255); INIT_MID_ANY: initial mid flags e0 or
 *   e0 - 1 each; STALE_MID: a history the OLD protocol leaves (see init);
 *   MISMATCH: rank W-1's call MIS_CALL (default 1) differs from the others'.
 * Mutants, each of which must make verification fail (README has the table):
 *   MUT_EXACT, MUT_SIGNED, MUT_ONE_BUF, MUT_NO_END_BARRIER, MUT_NO_MID_STORE,
 *   MUT_AG_NO_MID_STORE, MUT_DESC_EARLY, MUT_DESC_SINGLE, MUT_DESC_AFTER_FLAG,
 *   MUT_NO_MID_BARRIER, MUT_RECOVERY_SKIP.
 *
 * Step granularity (README has the arguments). Every store into another
 * rank's region (a call's descriptor, start flag and mid flag for that
 * region, or one barrier flag) is an atomic step of its own, and a barrier's
 * stores go in any order (the GPU stores with one thread per peer). Stores
 * into the OWN region are read by nobody else and join a neighbouring step.
 * A wait is one step that passes once every flag is reached. Data accesses
 * join a neighbouring step in the direction that can only widen them: a
 * read "begins" no later than the step that allows it and "ends" no earlier
 * than the process's next flag store or next call, and its buffer is
 * checked at both ends, so a write into it by anyone while it is read is
 * caught.
 */

#ifndef W
#define W 2
#endif
#ifndef NB
#define NB 1
#endif
#ifndef NCALLS
#define NCALLS 4
#endif
#ifndef MIS_CALL
#define MIS_CALL 1
#endif

/* uint32_t counters as bytes: every comparison the protocol makes is modulo
 * 2^k and only differences and parity enter it (README: "Epochs"). */
#define MASK 255

/* ---- call kinds: CallDesc::kind's algo x mode ---------------------------- */
#define K_1S 1  /* one-shot, kModeStaged                                      */
#define K_1R 2  /* one-shot, kModeRegistered: end barrier at e+1, 2 epochs     */
#define K_2S 3  /* two-shot, kModeStaged                                      */
#define K_2R 4  /* two-shot, kModeRegistered: no end barrier, 1 epoch          */
#define K_2I 5  /* two-shot, kModeRegisteredInPlace: end barrier, 2 epochs     */
#define K_AG 6  /* kAgreeOnly (a kModeFallback call): no data                 */
#define K_WILD 7 /* a stale descriptor's kind: equal to every kind, so only its
                    epoch field can tell that it is not this call's          */

#define ONE_SHOT(k)   ((k) == K_1S || (k) == K_1R)
#define TWO_SHOT(k)   ((k) == K_2S || (k) == K_2R || (k) == K_2I)
#define STAGED_SRC(k) ((k) == K_1S || (k) == K_2S)   /* sources: data[e % 2]  */
#define END_BAR(k)    ((k) == K_1R || (k) == K_2I)   /* zero-copy end barrier */
#ifdef MUT_NO_END_BARRIER
#define END_BAR_ON(k) false
#define EPOCHS(k)     1
#else
#define END_BAR_ON(k) END_BAR(k)
#define EPOCHS(k)     (END_BAR(k) -> 2 : 1)          /* desc_epochs_used()    */
#endif

/* The calls every rank makes: kernel calls (STAGED_ONLY: the staged ones,
 * which are all the host backend runs), plus agreement-only rounds under
 * WITH_AGREE. A kAgreeOnly call stores the same flags at the same points as
 * a staged one-shot and moves no data, so without WITH_AGREE its runs are
 * K_1S runs minus data checks; under MISMATCH it is one of the calls that
 * can face a kernel call. */
#ifdef WITH_AGREE
#define AGREE_TOO(x) :: x = K_AG
#else
#define AGREE_TOO(x)
#endif
#ifdef STAGED_ONLY
#define CHOOSE_KIND(x) if :: x = K_1S :: x = K_2S AGREE_TOO(x) fi
#define CHOOSE_OTHER(x, y) \
  if :: y != K_1S -> x = K_1S :: y != K_2S -> x = K_2S :: y != K_AG -> x = K_AG fi
#else
#define CHOOSE_KIND(x) if :: x = K_1S :: x = K_1R :: x = K_2S :: x = K_2R :: x = K_2I AGREE_TOO(x) fi
#define CHOOSE_OTHER(x, y)                                                       \
  if :: y != K_1S -> x = K_1S :: y != K_1R -> x = K_1R :: y != K_2S -> x = K_2S   \
     :: y != K_2R -> x = K_2R :: y != K_2I -> x = K_2I :: y != K_AG -> x = K_AG fi
#endif

/* ---- epoch_reached(flag, e) --------------------------------------------- */
#if defined(MUT_EXACT)
#define REACHED(f, e) ((f) == (e))
#elif defined(MUT_SIGNED)
#define REACHED(f, e) ((((f) - (e)) & MASK) < 128)   /* int32_t(flag - e) >= 0 */
#else
#define REACHED(f, e) ((((f) - (e)) & MASK) <= 1)    /* uint32_t(flag - e) <= 1 */
#endif

/* staging_offset(e) and desc_offset(e): parity of the epoch */
#ifdef MUT_ONE_BUF
#define DPAR(e) 0
#else
#define DPAR(e) ((e) & 1)
#endif
#ifdef MUT_DESC_SINGLE
#define CPAR(e) 0
#else
#define CPAR(e) ((e) & 1)
#endif

/* ---- shared memory ---------------------------------------------------------
 * Rank r's region: start_flags[b][q] and mid_flags[b][q] (written by rank q's
 * block b), epoch[b], desc[p][b][q], data[p] (block b's chunk owned by rank j:
 * one tag). reg: rank r's registered (zero-copy) input, block b's chunk j.
 * Chunk c belongs to block (c / W) % nblocks and to owner c % W (protocol.h
 * chunk_block, chunk_owner_rank), so a block only ever touches its own
 * chunks, and one group of W chunks (one per owner) per block suffices. */
#define FI(r, b, q)    (((r) * NB + (b)) * W + (q))
#define DI(r, p, b, q) ((((r) * 2 + (p)) * NB + (b)) * W + (q))
#define RI(r, b, j)    (((r) * NB + (b)) * W + (j))

byte start_f[W * NB * W];
byte mid_f[W * NB * W];
byte epoch[W * NB];
byte desc_ep[W * 2 * NB * W];    /* CallDesc::epoch */
byte desc_kind[W * 2 * NB * W];  /* CallDesc::kind (bytes and dtype: same on every rank here) */
byte data[W * 2 * NB * W];       /* staging buffers */
byte reg[W * NB * W];            /* registered inputs */

/* Ghosts. The true epoch (offset from the initial epoch E0; it never wraps
 * here) of the last store each writer made into each flag word: a barrier
 * at true epoch t may pass only if every peer stored t or later. */
byte g_start[W * NB * W];
byte g_mid[W * NB * W];
byte e0;                         /* the initial epoch */
byte kinds[NCALLS];              /* the call every rank makes (0: not chosen yet) */
#ifdef MISMATCH
byte odd_kind;                   /* rank W-1's call MIS_CALL */
#endif

/* Tags: 0 = left by the history; RAW(c) = call c's input; RED(c) = call c's
 * reduced chunk. CALL is the running call of the process. */
#define RAW(c) (2 * (c) + 1)
#define RED(c) (2 * (c) + 2)
#define CALL (k - 1)

/* Where chunk j of rank q's source is, and where owner q leaves its reduced
 * chunk, in the running call (kind, e) of block b. */
#define SRC(q, j)  (STAGED_SRC(kind) -> data[DI(q, DPAR(e), b, j)] : reg[RI(q, b, j)])
#define RED_AT(q)  (kind == K_2I -> reg[RI(q, b, q)] : data[DI(q, DPAR(e), b, q)])

#if W == 2
#define ALL 3
#define FOR_RANKS(OPT, a) OPT(0, a) OPT(1, a)
#elif W == 3
#define ALL 7
#define FOR_RANKS(OPT, a) OPT(0, a) OPT(1, a) OPT(2, a)
#else
#error "the model is written for W = 2 or 3"
#endif

/* ---- the data a call reads ------------------------------------------------- */
/* one-shot: every chunk of every rank's source */
#define CHECK_ALL_SOURCES(c)                                                     \
  q = 0;                                                                         \
  do                                                                             \
  :: q < W ->                                                                    \
    j = 0;                                                                       \
    do                                                                           \
    :: j < W -> assert(SRC(q, j) == RAW(c)); j++                                 \
    :: else -> j = 0; break                                                      \
    od;                                                                          \
    q++                                                                          \
  :: else -> q = 0; break                                                        \
  od
/* two-shot reduce-scatter: my chunk (j = r) of every source, but my own
 * once I reduced into it (staged: own staging; in place: own input) */
#define CHECK_MY_CHUNKS(c, skip_own)                                             \
  q = 0;                                                                         \
  do                                                                             \
  :: q < W -> assert((skip_own && q == r) || SRC(q, r) == RAW(c)); q++           \
  :: else -> q = 0; break                                                        \
  od
/* two-shot all-gather: every other owner's reduced chunk */
#define CHECK_GATHER(c)                                                          \
  j = 0;                                                                         \
  do                                                                             \
  :: j < W -> assert(j == r || RED_AT(j) == RED(c)); j++                         \
  :: else -> j = 0; break                                                        \
  od
/* in place, the all-gather writes the other owners' chunks into my input */
#define GATHER_WRITE(c)                                                          \
  if                                                                             \
  :: kind == K_2I ->                                                             \
    j = 0;                                                                       \
    do                                                                           \
    :: j < W -> if :: j != r -> reg[RI(r, b, j)] = RED(c) :: else -> skip fi; j++ \
    :: else -> j = 0; break                                                      \
    od                                                                           \
  :: else -> skip                                                                \
  fi
/* the all-gather begins; without end barrier its reads stay open */
#define GATHER_BEGIN                                                             \
  CHECK_GATHER(CALL);                                                            \
  GATHER_WRITE(CALL);                                                            \
  if                                                                             \
  :: !END_BAR_ON(kind) -> pend = 2                                               \
  :: else -> skip                                                                \
  fi
/* the end of the reads a call without end barrier leaves open: they end no
 * later than the process's next call */
#define PENDING_END(c)                                                           \
  if                                                                             \
  :: pend == 1 -> CHECK_ALL_SOURCES(c)                                           \
  :: pend == 2 -> CHECK_GATHER(c)                                                \
  :: else -> skip                                                                \
  fi;                                                                            \
  pend = 0

/* ---- flag stores ------------------------------------------------------------- */
/* printf only shows when a trail is replayed (spin -t): the story of a
 * counterexample. */
#define FLAG_TO(flags, ghost, ep, tt, q)                                         \
  flags[FI(q, b, r)] = ep; ghost[FI(q, b, r)] = tt; STORED_##flags(ep, q)
#define STORED_start_f(ep, q) \
  printf("rank %d block %d: start_flags[%d][%d] = %d in rank %d's region\n", r, b, b, r, ep, q)
#define STORED_mid_f(ep, q) \
  printf("rank %d block %d: mid_flags[%d][%d] = %d in rank %d's region\n", r, b, b, r, ep, q)
#define PASSED_start_f(ep) printf("rank %d block %d: passed start_flags barrier %d\n", r, b, ep)
#define PASSED_mid_f(ep) printf("rank %d block %d: passed mid_flags barrier %d\n", r, b, ep)
#define DESC_TO(q) desc_ep[DI(q, CPAR(e), b, r)] = e; desc_kind[DI(q, CPAR(e), b, r)] = kind
/* a call without mid barrier stores e into the mid flags too */
#if defined(MUT_NO_MID_STORE)
#define MID_TOO(q) skip
#else
#if defined(MUT_AG_NO_MID_STORE)
#define NEEDS_MID_STORE(k) ONE_SHOT(k)
#else
#define NEEDS_MID_STORE(k) (!TWO_SHOT(k))
#endif
#define MID_TOO(q)                                                               \
  if                                                                             \
  :: NEEDS_MID_STORE(kind) -> FLAG_TO(mid_f, g_mid, e, t, q)                     \
  :: else -> skip                                                                \
  fi
#endif
/* start, per region q: desc[e % 2][b][me] (plain), start_flags[b][me] = e
 * (release), one-shot: mid_flags[b][me] = e (release) */
#ifdef MUT_DESC_AFTER_FLAG
#define PUBLISH(q) FLAG_TO(start_f, g_start, e, t, q); MID_TOO(q); DESC_TO(q)
#else
#define PUBLISH(q) DESC_TO(q); FLAG_TO(start_f, g_start, e, t, q); MID_TOO(q)
#endif

#define APPLY(m, args) m args
#define UNPACK(...) __VA_ARGS__

/* One option per peer i (i != r): act on i once, in any order; the option
 * that completes the set leaves the loop. Between loops, mask = 1 << r: own
 * region done. */
#define PEER_STEP(i, guard, action, last)                                        \
  :: atomic { i != r && !(mask & (1 << i)) && guard ->                           \
       action; mask = mask | (1 << i);                                           \
       if                                                                        \
       :: mask == ALL -> mask = 1 << r; last; break                              \
       :: else -> skip                                                           \
       fi }

/* On arriving at a barrier (its last store), the flags it waits for are at
 * most two epochs behind and one ahead (protocol.h: "no flag is ever
 * 2^32 - 2 epochs stale"), so "reached" cannot alias. Not checked under
 * STALE_MID, whose history is not one of this protocol: there the ghosts
 * and the data show what a stale flag does. */
#define IN_WINDOW(f, ep) ((((f) - (ep) + 2) & MASK) <= 3)
#if W == 2
#define WINDOW_(flags, ghost, ep, tt)                                            \
  (IN_WINDOW(flags[FI(r, b, 0)], ep) && IN_WINDOW(flags[FI(r, b, 1)], ep))
#else
#define WINDOW_(flags, ghost, ep, tt)                                            \
  (IN_WINDOW(flags[FI(r, b, 0)], ep) && IN_WINDOW(flags[FI(r, b, 1)], ep) &&       \
   IN_WINDOW(flags[FI(r, b, 2)], ep))
#endif
#ifdef STALE_MID
#define WINDOW_OK(bar) skip
#else
#define WINDOW_OK(bar) assert(APPLY(WINDOW_, bar))
#endif

#ifdef MUT_DESC_AFTER_FLAG
#define PUBLISH_OPT(i, unused)                                                   \
  :: atomic { i != r && !(mask & (1 << i)) && !(half & (1 << i)) ->              \
       FLAG_TO(start_f, g_start, e, t, i); MID_TOO(i); half = half | (1 << i) }   \
  PEER_STEP(i, (half & (1 << i)), DESC_TO(i), half = 0; WINDOW_OK(START_BAR))
#else
#define PUBLISH_OPT(i, unused) PEER_STEP(i, true, PUBLISH(i), WINDOW_OK(START_BAR))
#endif
#define PUBLISH_PEERS do FOR_RANKS(PUBLISH_OPT, 0) od

/* Barrier on one flag array at epoch ep (true epoch tt), given as
 * bar = (flags, ghost, ep, tt): store into every region (the own one in the
 * step before), in any order, then wait until own flags[b][q] reached ep
 * for every q. The wait is one step that passes once all are reached
 * together; the real code reads the flags one by one, which differs only if
 * a flag could leave the window while a waiter has not passed yet, and then
 * a run in which the waiter reads it too late deadlocks here as well
 * (README: "Waits"). On passing, the ghosts say whether every peer really
 * stored ep or later. WAIT_PEERS_THEN_GATHER also begins the all-gather's reads
 * (a read may only "begin" early). */
#define STORE_OPT(i, bar) PEER_STEP(i, true, STORE_ONE(i, bar), WINDOW_OK(bar))
#define STORE_ONLY_OPT(i, bar) PEER_STEP(i, true, STORE_ONE(i, bar), skip)
#define STORE_ONE(i, bar) APPLY(FLAG_TO, (UNPACK bar, i))
#define STORE_PEERS(bar) do FOR_RANKS(STORE_OPT, bar) od
#define STORE_PEERS_NO_WAIT(bar) do FOR_RANKS(STORE_ONLY_OPT, bar) od
#define SELF_STORE(bar) STORE_ONE(r, bar)
#if W == 2
#define ALL_REACHED_(flags, ghost, ep, tt)                                       \
  (REACHED(flags[FI(r, b, 0)], ep) && REACHED(flags[FI(r, b, 1)], ep))
#define GHOSTS_OK_(flags, ghost, ep, tt)                                         \
  assert(ghost[FI(r, b, 0)] >= tt && ghost[FI(r, b, 1)] >= tt)
#else
#define ALL_REACHED_(flags, ghost, ep, tt)                                       \
  (REACHED(flags[FI(r, b, 0)], ep) && REACHED(flags[FI(r, b, 1)], ep) &&          \
   REACHED(flags[FI(r, b, 2)], ep))
#define GHOSTS_OK_(flags, ghost, ep, tt)                                         \
  assert(ghost[FI(r, b, 0)] >= tt && ghost[FI(r, b, 1)] >= tt && ghost[FI(r, b, 2)] >= tt)
#endif
#define PASSED_(flags, ghost, ep, tt) PASSED_##flags(ep)
#define WAIT_PEERS(bar) \
  atomic { APPLY(ALL_REACHED_, bar) -> APPLY(GHOSTS_OK_, bar); APPLY(PASSED_, bar) }
#define WAIT_PEERS_THEN_GATHER(bar)                                              \
  atomic { APPLY(ALL_REACHED_, bar) -> APPLY(GHOSTS_OK_, bar); APPLY(PASSED_, bar); GATHER_BEGIN }
/* the barriers */
#define START_BAR (start_f, g_start, e, t)
#define MID_BAR   (mid_f, g_mid, e, t)
#define END_BAR_  (start_f, g_start, (e + 1) & MASK, t + 1)

/* ---- the descriptor check and the two-shot phases ------------------------- */
#define DESC_BAD_Q(q)                                                            \
  (desc_ep[DI(r, CPAR(e), b, q)] != e ||                                         \
   (desc_kind[DI(r, CPAR(e), b, q)] != kind && desc_kind[DI(r, CPAR(e), b, q)] != K_WILD))
#if W == 2
#define DESC_BAD (DESC_BAD_Q(0) || DESC_BAD_Q(1))
#else
#define DESC_BAD (DESC_BAD_Q(0) || DESC_BAD_Q(1) || DESC_BAD_Q(2))
#endif
/* every rank detects a mismatch, and only a real one */
#ifdef MISMATCH
#define DETECTED(x) assert((x) == (CALL == MIS_CALL))
#else
#define DETECTED(x) assert(!(x))
#endif
/* reduce-scatter: read my chunk of every source, write the sum into my
 * reduced buffer (the reads end at my first mid-flag store) */
#define REDUCE                                                                   \
  CHECK_MY_CHUNKS(CALL, false);                                                  \
  if                                                                             \
  :: kind == K_2I -> reg[RI(r, b, r)] = RED(CALL)                                \
  :: else -> data[DI(r, DPAR(e), b, r)] = RED(CALL)                              \
  fi
/* the mid barrier, and after it the all-gather from every other owner (in
 * place: into own input) */
#ifdef MUT_NO_MID_BARRIER
#define MID_THEN_GATHER atomic { CHECK_MY_CHUNKS(CALL, kind != K_2R); GATHER_BEGIN }
#else
#define MID_THEN_GATHER                                                          \
  atomic { CHECK_MY_CHUNKS(CALL, kind != K_2R); SELF_STORE(MID_BAR) };           \
  STORE_PEERS(MID_BAR);                                                          \
  WAIT_PEERS_THEN_GATHER(MID_BAR)
#endif

proctype Block(byte r; byte b)
{
  byte k = 0;     /* calls started; the running call is CALL = k - 1 */
  byte e;         /* its epoch: e = ++epoch[b], modulo 2^8 */
  byte t;         /* ghost: e - e0 without wrap */
  byte kind;
  byte q, j;
  byte mask = 1 << r;
#ifdef MUT_DESC_AFTER_FLAG
  byte half;
#endif
  byte maxu;      /* mismatch: most epochs any rank's call uses */
  byte pend;      /* reads of the last call still open: 1 one-shot, 2 gather */
#ifdef MUT_DESC_EARLY
  bool bad;       /* the descriptors disagree */
#endif

  do
  :: atomic { k < NCALLS ->
      PENDING_END(CALL);
      k++;
      /* The call; its caller writes its input (into the registered buffer
       * for a zero-copy call, which may change from the moment the previous
       * call returned). */
      if
      :: kinds[CALL] == 0 -> CHOOSE_KIND(kinds[CALL])
      :: else -> skip
      fi;
      kind = kinds[CALL];
#ifdef MISMATCH
      if
      :: CALL == MIS_CALL && r == W - 1 ->
        if
        :: odd_kind == 0 -> CHOOSE_OTHER(odd_kind, kind)
        :: else -> skip
        fi;
        kind = odd_kind
      :: else -> skip
      fi;
#endif
      j = 0;
      do
      :: j < W -> reg[RI(r, b, j)] = RAW(CALL); j++
      :: else -> j = 0; break
      od;
      /* advance_epoch(): e = epoch + 1; epoch = e + epochs_used - 1 */
      e = (epoch[r * NB + b] + 1) & MASK;
      epoch[r * NB + b] = (e + EPOCHS(kind) - 1) & MASK;
      t = (e - e0) & MASK;
      printf("rank %d block %d: call %d, kind %d, e = %d\n", r, b, CALL, kind, e);
      /* copy-in: input -> own data[e % 2] */
      if
      :: STAGED_SRC(kind) ->
        j = 0;
        do
        :: j < W -> data[DI(r, DPAR(e), b, j)] = RAW(CALL); j++
        :: else -> j = 0; break
        od
      :: else -> skip
      fi;
      PUBLISH(r)
    };
    PUBLISH_PEERS;

    /* start barrier, then agree: own.desc[e % 2][b][q] == my CallDesc for
     * every q, before any peer data is read */
#ifdef MUT_DESC_EARLY
    atomic { bad = DESC_BAD };
    WAIT_PEERS(START_BAR);
#define BAD_NOW bad
#else
    WAIT_PEERS(START_BAR);
#define BAD_NOW DESC_BAD
#endif
    if
    :: atomic { BAD_NOW ->
      /* Mismatch: no output; put epoch and mid flags in step. */
      printf("rank %d block %d: descriptors disagree at %d\n", r, b, e);
      DETECTED(true);
#ifdef MUT_RECOVERY_SKIP
      /* the first recovery tried: epoch = e + (most epochs any rank's call
       * uses) - 1, which lets the rank that found the mismatch first reach
       * e + 2 and overwrite its start flag and desc[e % 2] before a slower
       * peer read them: a deadlock (README, "Finding") */
      maxu = EPOCHS(kind);
      q = 0;
      do
      :: q < W ->
        if
        :: EPOCHS(desc_kind[DI(r, CPAR(e), b, q)]) > maxu -> maxu = EPOCHS(desc_kind[DI(r, CPAR(e), b, q)])
        :: else -> skip
        fi;
        q++
      :: else -> q = 0; break
      od;
      epoch[r * NB + b] = (e + maxu - 1) & MASK;
      maxu = 0;
#else
      /* protocol.h: the epoch counter goes back to e (a kind that uses two
       * epochs had reserved e + 1), so every rank continues from e + 1 */
      epoch[r * NB + b] = e;
#endif
      printf("rank %d block %d: epoch = %d\n", r, b, epoch[r * NB + b]);
#ifdef MUT_DESC_EARLY
      bad = false;
#endif
      /* mid flags at e (a call without mid barrier stored them already) */
      if
      :: TWO_SHOT(kind) -> SELF_STORE(MID_BAR)
      :: else -> skip
      fi
    };
    if
    :: TWO_SHOT(kind) -> STORE_PEERS_NO_WAIT(MID_BAR)
    :: else -> skip
    fi;

    /* one-shot: out = sum over q of peer[q]'s source; registered: the reads
     * end at the end barrier (start_flags, e + 1) */
    :: atomic { !BAD_NOW && ONE_SHOT(kind) && !END_BAR_ON(kind) ->
      DETECTED(false); CHECK_ALL_SOURCES(CALL); pend = 1 }
    :: atomic { !BAD_NOW && ONE_SHOT(kind) && END_BAR_ON(kind) ->
      DETECTED(false); CHECK_ALL_SOURCES(CALL) };
      atomic { CHECK_ALL_SOURCES(CALL); SELF_STORE(END_BAR_) };
      STORE_PEERS(END_BAR_);
      WAIT_PEERS(END_BAR_)

    /* two-shot: reduce my chunks into own data[e % 2] (in place: into own
     * input), mid barrier, all-gather; in place: end barrier */
    :: atomic { !BAD_NOW && TWO_SHOT(kind) && !END_BAR_ON(kind) ->
      DETECTED(false); REDUCE };
      MID_THEN_GATHER
    :: atomic { !BAD_NOW && TWO_SHOT(kind) && END_BAR_ON(kind) ->
      DETECTED(false); REDUCE };
      MID_THEN_GATHER;
      atomic { CHECK_GATHER(CALL); SELF_STORE(END_BAR_) };
      STORE_PEERS(END_BAR_);
      WAIT_PEERS(END_BAR_)

    :: atomic { !BAD_NOW && kind == K_AG -> DETECTED(false) }  /* no data */
    fi

  :: atomic { k == NCALLS -> PENDING_END(CALL) };
    break
  od
}

init
{
  byte r, b, q, p;
  atomic {
    /* The state any history leaves between calls. Only differences of
     * counters modulo 2^32 and the parity of epochs enter the protocol, so
     * an initial epoch of each parity, close enough to the wrap that the
     * run crosses it, stands for every value (README: "Epochs"). After any
     * history of this protocol the start flags hold e0 and the mid flags e0,
     * or e0 - 1 after a call that used two epochs: the first call below
     * leaves either for the calls after it (INIT_MID_ANY: either, per flag,
     * from the start). Descriptors hold epochs e0 and e0 - 1 and any kind
     * (K_WILD); buffers hold no call's data (tag 0). */
#if defined(STALE_MID)
    /* A history of the OLD protocol (no mid-flag store in one-shot calls):
     * the zeroed region after only one-shot calls, close to the wrap: the
     * first two-shot call runs at 254, 255 or 0 facing mid flags 0. */
    e0 = 253;
#elif defined(E0)
    e0 = E0;
#elif defined(E0_ALL)
    select (e0 : 0 .. 255);
#elif defined(E0_WIDE)
    if
    :: e0 = 0
    :: e0 = 1
    :: e0 = 127
    :: e0 = 128
    :: e0 = 254
    :: e0 = 255
    fi;
#else
    if
    :: e0 = 254
    :: e0 = 255
    fi;
#endif
    r = 0;
    do
    :: r < W ->
      b = 0;
      do
      :: b < NB ->
        epoch[r * NB + b] = e0;
        q = 0;
        do
        :: q < W ->
          start_f[FI(r, b, q)] = e0;
#if defined(STALE_MID)
          mid_f[FI(r, b, q)] = 0;
#elif defined(INIT_MID_ANY)
          if
          :: mid_f[FI(r, b, q)] = e0
          :: mid_f[FI(r, b, q)] = (e0 - 1) & MASK
          fi;
#else
          mid_f[FI(r, b, q)] = e0;
#endif
          p = 0;
          do
          :: p < 2 ->
            desc_ep[DI(r, p, b, q)] = (((e0 & 1) == p) -> e0 : ((e0 - 1) & MASK));
            desc_kind[DI(r, p, b, q)] = K_WILD;
            p++
          :: else -> break
          od;
          q++
        :: else -> break
        od;
        b++
      :: else -> break
      od;
      r++
    :: else -> break
    od;
    r = 0;
    do
    :: r < W ->
      b = 0;
      do
      :: b < NB -> run Block(r, b); b++
      :: else -> break
      od;
      r++
    :: else -> break
    od
  }
}
