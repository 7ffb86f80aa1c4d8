/* The kernels' software prefetches (weights ahead of the tiles, KV blocks ahead of decode attention) bring data into
 * the L2 (GCC's locality hint 1: prefetcht2), not the L1: a 32 KiB L1 holds the tile's inputs and sums, and lines
 * pulled into it a block or 32 KiB ahead pushed those out. On a Zen 4, decode attention alone ran 1.28x faster and
 * the bench workload 1.07x (float32) and 1.15x (int8) faster than with hint 3 (docs/performance.md). */
#ifndef CPU_PREFETCH_H
#define CPU_PREFETCH_H
#define PREFETCH_TO_L2(address) __builtin_prefetch((address), 0, 1)
#endif
