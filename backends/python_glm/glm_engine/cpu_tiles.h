/* Shared by the tiled kernels (cpu_f32_tile.h's users, cpu_int8_kernel.c): run the tile for `left` rows, at most
 * ROWS (6 or 8), through a switch over constant counts, so that each count is its own unrolled copy of the tile.
 * The includer defines ROWS first, and TILE(COUNT) where it calls this. */

#if ROWS == 8
#define LARGE_TILES \
    case 8: TILE(8); break; \
    case 7: TILE(7); break;
#elif ROWS == 6
#define LARGE_TILES
#else
#error "cpu_tiles.h: ROWS must be 6 or 8"
#endif

#define RUN_TILE(left)                                   \
    switch ((left) < ROWS ? (left) : ROWS) {             \
    LARGE_TILES                                          \
    case 6: TILE(6); break;                              \
    case 5: TILE(5); break;                              \
    case 4: TILE(4); break;                              \
    case 3: TILE(3); break;                              \
    case 2: TILE(2); break;                              \
    case 1: TILE(1); break;                              \
    }
