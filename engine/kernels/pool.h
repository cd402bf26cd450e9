/* The kernels' thread pool (pool.c). */
#pragma once
#include <stdint.h>

typedef void (*task_fn)(void *ctx, int64_t item);

/* fn(ctx, i) for i in 0 .. items - 1, on the calling thread and up to threads - 1 workers; returns when all are done */
void pool_run(task_fn fn, void *ctx, int64_t items, int threads);
