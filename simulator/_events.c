/* The event loop of simulator/engine.py in C, step for step the same (same heap order, same
 * floating-point operations in the same order), so both give identical start and end times.
 * Built by simulator/native.py with the system C compiler and loaded through ctypes.
 *
 * run_events(n, nd, nl, ne, src, dst, duration, res_first, res, start, end)
 *   src/dst: the ne edges, turned here into the CSR of TaskGraph.adjacency_arrays (a counting
 *   sort by source, stable: each task's successors in edge order); res_first/res: CSR
 *   resources (device d is d, link l is nd + l). Indices are int32 (the task graph's arrays
 *   are: half the memory traffic of int64). Returns the number of tasks placed (n unless
 *   a cycle), or -1 when out of memory or
 *   past 2^31 - 1 tasks or edges (the Python loop then runs).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { double key; int64_t t; } Item;

static int less(Item a, Item b) { return a.key < b.key || (a.key == b.key && a.t < b.t); }

static void push(Item *h, int64_t *size, Item x) {
    int64_t i = (*size)++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!less(x, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static Item pop(Item *h, int64_t *size) {
    Item top = h[0], x = h[--(*size)];
    int64_t i = 0, n = *size;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && less(h[c + 1], h[c])) c++;
        if (!less(h[c], x)) break;
        h[i] = h[c];
        i = c;
    }
    if (n > 0) h[i] = x;
    return top;
}

typedef struct { double *st, *en; int64_t len, cap; } Link;

/* first index i with en[i] > s (Python's bisect_right); the same index found first where s is
 * past the link's last interval (a link's tasks mostly come in time order), else by bisection */
static int64_t bisect_right(const double *en, int64_t len, double s) {
    if (len == 0 || en[len - 1] <= s) return len;
    int64_t lo = 0, hi = len - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (s < en[mid]) hi = mid; else lo = mid + 1;
    }
    return lo;
}

static int insert(Link *L, int64_t i, double s, double e) {
    if (L->len == L->cap) {
        int64_t cap = L->cap ? 2 * L->cap : 16;
        double *st = realloc(L->st, cap * sizeof(double)), *en;
        if (!st) return -1;
        L->st = st;
        en = realloc(L->en, cap * sizeof(double));
        if (!en) return -1;
        L->en = en;
        L->cap = cap;
    }
    memmove(L->st + i + 1, L->st + i, (L->len - i) * sizeof(double));
    memmove(L->en + i + 1, L->en + i, (L->len - i) * sizeof(double));
    L->st[i] = s;
    L->en[i] = e;
    L->len++;
    return 0;
}

/* first/succ: the CSR of the edges by source, in edge order; remaining: predecessor counts.
 * 32-bit indices (run_events checks they fit): the loop is bound by memory traffic. first[t]
 * is filled from first[t + 1]'s slot and shifted back, so no second cursor array is needed. */
static void adjacency(int64_t n, int64_t ne, const int32_t *src, const int32_t *dst, int32_t *first,
                      int32_t *succ, int32_t *remaining) {
    memset(first, 0, (n + 2) * sizeof(int32_t));
    memset(remaining, 0, n * sizeof(int32_t));
    for (int64_t i = 0; i < ne; i++) {
        first[src[i] + 2]++;
        remaining[dst[i]]++;
    }
    for (int64_t t = 1; t <= n; t++) first[t + 1] += first[t];  /* first[t + 1]: where t's run starts */
    for (int64_t i = 0; i < ne; i++) succ[first[src[i] + 1]++] = dst[i];  /* ... and ends */
}

int64_t run_events(int64_t n, int64_t nd, int64_t nl, int64_t ne, const int32_t *src, const int32_t *dst,
                   const double *duration, const int32_t *res_first, const int32_t *res, double *start,
                   double *end) {
    if (n >= INT32_MAX || ne >= INT32_MAX) return -1;  /* 32-bit indices: the Python loop runs */
    double *ready = calloc(n ? n : 1, sizeof(double)), *free_ = calloc(nd ? nd : 1, sizeof(double));
    int32_t *remaining = malloc((n ? n : 1) * sizeof(int32_t)), *first = malloc((n + 2) * sizeof(int32_t));
    int32_t *succ = malloc((ne ? ne : 1) * sizeof(int32_t));
    Item *heap = malloc((n ? n : 1) * sizeof(Item));
    Link *links = calloc(nl ? nl : 1, sizeof(Link));
    int64_t size = 0, done = -1, placed = 0;
    if (!ready || !free_ || !remaining || !first || !succ || !heap || !links) goto out;
    adjacency(n, ne, src, dst, first, succ, remaining);
    for (int64_t t = 0; t < n; t++)
        if (remaining[t] == 0) push(heap, &size, (Item){0.0, t});
    while (size > 0) {
        Item it = pop(heap, &size);
        double r = it.key, d = duration[it.t], s, e;
        int64_t t = it.t, r0 = res_first[t], r1 = res_first[t + 1];
        if (r1 - r0 == 1 && res[r0] < nd) {  /* one compute stream: the common case */
            int64_t x = res[r0];
            s = free_[x] > r ? free_[x] : r;
            e = free_[x] = s + d;
        } else {  /* engine._place */
            int moved = 1;
            s = r;
            for (int64_t k = r0; k < r1; k++)
                if (res[k] < nd && free_[res[k]] > s) s = free_[res[k]];
            while (moved) {
                moved = 0;
                for (int64_t k = r0; k < r1; k++) {
                    if (res[k] < nd) continue;
                    Link *L = &links[res[k] - nd];
                    int64_t i = bisect_right(L->en, L->len, s);
                    while (i < L->len && L->st[i] < s + d) {
                        s = L->en[i];
                        i++;
                        moved = 1;
                    }
                }
            }
            e = s + d;
            for (int64_t k = r0; k < r1; k++) {
                if (res[k] < nd) {
                    free_[res[k]] = e;
                    continue;
                }
                Link *L = &links[res[k] - nd];
                int64_t i = bisect_right(L->en, L->len, s);
                if (i > 0 && L->en[i - 1] == s) L->en[i - 1] = e;
                else if (insert(L, i, s, e)) goto out;
            }
        }
        start[t] = s;
        end[t] = e;
        placed++;
        for (int32_t i = first[t], stop = first[t + 1]; i < stop; i++) {
            int32_t u = succ[i];
            if (e > ready[u]) ready[u] = e;
            if (--remaining[u] == 0) push(heap, &size, (Item){ready[u], u});
        }
    }
    done = placed;
out:
    if (links) {
        for (int64_t k = 0; k < nl; k++) { free(links[k].st); free(links[k].en); }
    }
    free(ready); free(free_); free(remaining); free(first); free(succ); free(heap); free(links);
    return done;
}
