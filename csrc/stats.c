/*
 * Traffic counters of one tag engine (ucxcomm/transport/_ucp.pyx's TagEngine): messages
 * and bytes per peer, sent and received, by the row of UCX's protocol table that a
 * message of its size takes (protocol and lane), and the receives that found their
 * message already there (unexpected). Plain integer increments on paths that already
 * run: a hash lookup (endpoint handle -> peer on a send, sender tag -> peer on a
 * receive) and a few compares; no locks (one thread drives an engine).
 *
 * Peers are slots: slot 0 counts what no route names (an unknown sender); the engine
 * maps its peer labels to slots.
 */
#include <stdlib.h>
#include <string.h>

#include "ucxcomm_ucp.h"

typedef struct {
    uint64_t key; /* + 1: 0 marks an empty entry */
    uint32_t slot;
} route_t;

typedef struct {
    route_t *t;
    size_t cap; /* a power of two, or 0 */
    size_t n;
} route_map_t;

struct ucxcomm_stats {
    ucxcomm_peer_stats_t *peers;
    size_t npeers, cap;
    route_map_t eps;  /* endpoint handle -> slot */
    route_map_t srcs; /* sender tag >> shift -> slot */
    unsigned shift;
};

static inline size_t route_hash(uint64_t key, size_t mask)
{
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 29) & mask;
}

static inline uint32_t route_get(const route_map_t *m, uint64_t key)
{
    size_t mask, i;
    if (m->cap == 0) {
        return 0;
    }
    key += 1;
    mask = m->cap - 1;
    for (i = route_hash(key, mask);; i = (i + 1) & mask) {
        uint64_t k = m->t[i].key;
        if (k == key) {
            return m->t[i].slot;
        }
        if (k == 0) {
            return 0;
        }
    }
}

static void route_place(route_t *t, size_t cap, uint64_t key1, uint32_t slot)
{
    size_t mask = cap - 1, i;
    for (i = route_hash(key1, mask); t[i].key != 0 && t[i].key != key1; i = (i + 1) & mask) {
    }
    t[i].key = key1;
    t[i].slot = slot;
}

static int route_set(route_map_t *m, uint64_t key, uint32_t slot)
{
    if ((m->n + 1) * 2 > m->cap) { /* keep it at most half full */
        size_t cap = m->cap ? m->cap * 2 : 64, i;
        route_t *t = calloc(cap, sizeof(*t));
        if (t == NULL) {
            return -1;
        }
        for (i = 0; i < m->cap; i++) {
            if (m->t[i].key != 0) {
                route_place(t, cap, m->t[i].key, m->t[i].slot);
            }
        }
        free(m->t);
        m->t = t;
        m->cap = cap;
    }
    if (route_get(m, key) == 0) {
        m->n++;
    }
    route_place(m->t, m->cap, key + 1, slot);
    return 0;
}

ucxcomm_stats_t *ucxcomm_stats_new(void)
{
    ucxcomm_stats_t *s = calloc(1, sizeof(*s));
    if (s != NULL && ucxcomm_stats_peer(s) != 0) { /* slot 0: unattributed */
        free(s);
        return NULL;
    }
    return s;
}

void ucxcomm_stats_free(ucxcomm_stats_t *s)
{
    if (s == NULL) {
        return;
    }
    free(s->peers);
    free(s->eps.t);
    free(s->srcs.t);
    free(s);
}

int ucxcomm_stats_peer(ucxcomm_stats_t *s)
{
    if (s->npeers == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        ucxcomm_peer_stats_t *p = realloc(s->peers, cap * sizeof(*p));
        if (p == NULL) {
            return -1;
        }
        s->peers = p;
        s->cap = cap;
    }
    memset(&s->peers[s->npeers], 0, sizeof(s->peers[0]));
    return (int)s->npeers++;
}

const ucxcomm_peer_stats_t *ucxcomm_stats_get(const ucxcomm_stats_t *s, int slot)
{
    return slot >= 0 && (size_t)slot < s->npeers ? &s->peers[slot] : NULL;
}

int ucxcomm_stats_route_ep(ucxcomm_stats_t *s, uintptr_t ep, int slot, int fast)
{
    if (slot <= 0 || (size_t)slot >= s->npeers) {
        return -1;
    }
    s->peers[slot].fast = fast;
    return route_set(&s->eps, ep, (uint32_t)slot);
}

int ucxcomm_stats_route_src(ucxcomm_stats_t *s, unsigned shift, uint64_t prefix, int slot)
{
    if (slot <= 0 || (size_t)slot >= s->npeers || shift >= 64
        || (s->srcs.n != 0 && shift != s->shift)) {
        return -1;
    }
    s->shift = shift;
    return route_set(&s->srcs, prefix, (uint32_t)slot);
}

int ucxcomm_stats_set_rows(ucxcomm_stats_t *s, int slot, int variant, const size_t *first,
                           unsigned rows)
{
    if (slot < 0 || (size_t)slot >= s->npeers || variant < 0 || variant > 1
        || rows > UCXCOMM_STATS_ROWS) {
        return -1;
    }
    memcpy(s->peers[slot].first[variant], first, rows * sizeof(*first));
    s->peers[slot].rows[variant] = rows;
    return 0;
}

/* The tally index of an n-byte message of variant v (-1: not classified). */
static inline unsigned row_of(const ucxcomm_peer_stats_t *p, int v, size_t n)
{
    unsigned r;
    if (v < 0 || p->rows[v] == 0) {
        return UCXCOMM_STATS_UNCLASSIFIED;
    }
    for (r = p->rows[v] - 1; r > 0 && n < p->first[v][r]; r--) {
    }
    return (unsigned)v * UCXCOMM_STATS_ROWS + r;
}

void ucxcomm_count_send(ucxcomm_stats_t *s, uintptr_t ep, size_t n, int variant)
{
    ucxcomm_peer_stats_t *p = &s->peers[route_get(&s->eps, ep)];
    ucxcomm_tally_t *t = &p->sent[row_of(p, variant, n)];
    t->messages++;
    t->bytes += n;
}

void ucxcomm_count_recv(ucxcomm_stats_t *s, uint64_t sender_tag, size_t n, int unexpected,
                        int device)
{
    ucxcomm_peer_stats_t *p =
        &s->peers[s->srcs.n ? route_get(&s->srcs, sender_tag >> s->shift) : 0];
    /* The sender chose the protocol: the variant it asks for at this size, assuming it
     * sees the same lanes (the endpoint's fast flag mirrors this side's). */
    ucxcomm_tally_t *t =
        &p->recv[row_of(p, device ? -1 : ucxcomm_fast_send(p->fast, n), n)];
    t->messages++;
    t->bytes += n;
    if (unexpected) {
        p->unexpected.messages++;
        p->unexpected.bytes += n;
    }
}
