/* The kernels' thread pool: `pool_run(fn, ctx, items, threads)` calls fn(ctx, i) for i in 0 .. items - 1 on the
 * calling thread and up to threads - 1 workers, and returns when all are done.
 *
 * Why not OpenMP: libgomp gives each thread that opens a parallel region a pool of its own, and once a process holds
 * more pool threads than CPUs (the engine's thread beside the one that loaded the model is enough on 2 cores) it
 * stops spinning between regions: every region then waits for its workers to wake, and a decode step of SmolLM2 runs
 * 150 of them (17 against 9 ms a step at batch 1). These workers spin for SPIN_US after their last task, so a step's
 * kernels, a few microseconds of Python apart, find them awake, and then sleep on a condition variable, so an idle
 * engine costs no CPU. One pool serves every kernel (they are one library), and calls from several threads (several
 * engines in one process) take turns.
 *
 * Kernels run with subnormal floats flushed to zero (the CPU's FTZ and DAZ flags, x86): an exp far below the row's
 * maximum, or a probability that small times a value, otherwise takes the CPU's slow path (a decode step of SmolLM2
 * at batch 24 ran 2.7x slower). The flags are set on the workers, which run nothing else, and on the calling thread
 * only for the duration of the call: the rest of the process keeps IEEE arithmetic.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#define FLUSH_SUBNORMALS 0x8040u /* MXCSR: flush to zero (bit 15), denormals are zero (bit 6) */
static inline unsigned flush_subnormals(void) {
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | FLUSH_SUBNORMALS);
    return saved;
}
static inline void restore_floats(unsigned saved) { _mm_setcsr(saved); }
#else
#define PAUSE() ((void)0)
static inline unsigned flush_subnormals(void) { return 0; }
static inline void restore_floats(unsigned saved) { (void)saved; }
#endif

#define SPIN_US 300
#define MAX_WORKERS 255

static struct {
    pthread_mutex_t run_lock; /* one pool_run at a time */
    pthread_mutex_t lock;     /* with wake: sleeping workers */
    pthread_cond_t wake;
    int workers;
    atomic_uint_fast64_t generation;
    atomic_int_fast64_t next;
    atomic_int pending;
    task_fn fn;
    void *ctx;
    int64_t items;
    int active; /* workers taking part in this generation */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void take_items(void) {
    for (int64_t i; (i = atomic_fetch_add(&pool.next, 1)) < pool.items;) pool.fn(pool.ctx, i);
}

struct birth {
    int index;
    uint_fast64_t generation; /* the generation before the call that started it: it answers the next one */
};

static void *worker(void *arg) {
    const struct birth birth = *(struct birth *)arg;
    free(arg);
    const int index = birth.index;
    uint_fast64_t seen = birth.generation;
    flush_subnormals(); /* for good: a worker runs kernels only */
    for (;;) {
        const double until = now_us() + SPIN_US;
        for (int spins = 0; atomic_load_explicit(&pool.generation, memory_order_acquire) == seen; spins++) {
            PAUSE();
            if ((spins & 255) == 255 && now_us() > until) {
                pthread_mutex_lock(&pool.lock);
                while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                pthread_mutex_unlock(&pool.lock);
            }
        }
        seen = atomic_load(&pool.generation);
        if (index < pool.active) take_items();
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

static void after_fork_in_child(void) { /* the workers did not come along */
    pool.workers = 0;
    pthread_mutex_init(&pool.run_lock, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
}

static void start_workers(int n) {
    if (pool.workers == 0) pthread_atfork(NULL, NULL, after_fork_in_child);
    for (; pool.workers < n && pool.workers < MAX_WORKERS; pool.workers++) {
        struct birth *birth = malloc(sizeof *birth);
        if (!birth) break;
        birth->index = pool.workers;
        birth->generation = atomic_load(&pool.generation);
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, birth) != 0) {
            free(birth);
            break;
        }
        pthread_detach(thread);
    }
}

void pool_run(task_fn fn, void *ctx, int64_t items, int threads) {
    if (items <= 0) return;
    pthread_mutex_lock(&pool.run_lock);
    const unsigned saved = flush_subnormals();
    int helpers = threads - 1;
    if (helpers > items - 1) helpers = (int)(items - 1);
    if (helpers > pool.workers) start_workers(helpers);
    if (helpers > pool.workers) helpers = pool.workers;
    if (helpers <= 0) {
        for (int64_t i = 0; i < items; i++) fn(ctx, i);
        restore_floats(saved);
        pthread_mutex_unlock(&pool.run_lock);
        return;
    }
    pool.fn = fn, pool.ctx = ctx, pool.items = items, pool.active = helpers;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.pending, pool.workers); /* every worker answers each generation, active or not */
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    take_items();
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) PAUSE();
    restore_floats(saved);
    pthread_mutex_unlock(&pool.run_lock);
}
