/*
 * fi_ceiling: the raw-libfabric ceiling fabric's engine is measured against.
 *
 * Two processes (this one forks the target) on one RDM provider: the initiator keeps a window
 * of fi_writedata() calls (RMA write carrying 64-bit remote CQ data, i.e. WriteImm) in flight
 * and polls its CQ in batches; the target polls its CQ and counts the remote CQ data
 * completions. No engine, no threads, no Python: whatever the engine loses against this is
 * overhead. Also measures the imm round trip: write+data -> target sees it -> write+data back.
 *
 * Build: cc -O2 -o fi_ceiling fi_ceiling.c -lfabric
 * Run:   FI_TCP_IFACE=lo ./fi_ceiling -p 'tcp;ofi_rxm' [-s 4096,65536,1048576] [-w 64] [-r 5] [-b SPAN] [-n BYTES]
 *
 * By default every write goes from offset 0 to offset 0: source and target stay in the CPU's
 * caches, the most a copy can do. With -b SPAN both buffers are SPAN bytes and write i uses
 * the i-th size-aligned slot, cycling, as a KV cache of SPAN bytes is written page by page:
 * what a copy does from and to memory. A repetition writes about 1 GiB (at least 2000 writes),
 * or -n BYTES.
 *
 * With -f T:I (fan) it measures a many-to-many transfer instead of a pair: T initiator and I
 * target processes (children of this one), each initiator writing -n BYTES per repetition
 * round robin to every target, as T training ranks push weights to I inference ranks. Time
 * runs from the first initiator's start to the last target's count of its imms (one
 * CLOCK_MONOTONIC for all): the aggregate bandwidth of that fan, whose receivers, on shm, are
 * the processes that copy. -b and -d as for a pair. Implies -l 0. -W N keeps at most N writes
 * outstanding per target instead of -w's window shared by all targets, posting round robin to
 * the targets with room: the raw form of fabric's per-peer queue depth (on shm a post to a
 * target busy copying its queue spins on the target's lock, and a shared window lets one busy
 * target hold up the others).
 *
 * With -N NICE the initiators run at that nice value (the targets at the caller's): on one
 * host over shm the targets do the copies, and initiators spinning in the provider on a
 * target's queue lock take CPU the copies need; senders and receivers on separate hosts do
 * not compete. `fabric bench rl --sender-nice` runs its trainers at the same value.
 * With -a [-A N] the target acknowledges the writes itself (see target_acks below).
 * Output: one JSON object per line on stdout.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define CHECK(call)                                                                      \
    do {                                                                                 \
        int rc_ = (int)(call);                                                           \
        if (rc_) {                                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, fi_strerror(-rc_)); \
            exit(2);                                                                     \
        }                                                                                \
    } while (0)

struct peer_info {
    char addr[256];
    size_t addrlen;
    uint64_t key;
    uint64_t base;
};

struct node {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    struct fid_mr *mr;
    void *desc;
    char *buf;
    size_t buflen;
    fi_addr_t peer;
    struct peer_info remote;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void xfer(int fd, void *p, size_t n, int send_it) {
    char *c = p;
    while (n) {
        ssize_t r = send_it ? write(fd, c, n) : read(fd, c, n);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            fprintf(stderr, "control socket closed\n");
            exit(3);
        }
        c += r;
        n -= (size_t)r;
    }
}

/* shm names a region after its process (/dev/shm/PID:N:M) and cannot create one whose file
 * exists: a process with this PID killed earlier left its file behind. None of ours exist yet. */
static void sweep_stale_regions(void) {
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    char prefix[32], path[300];
    int len = snprintf(prefix, sizeof(prefix), "%d:", (int)getpid());
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, (size_t)len) == 0) {
            snprintf(path, sizeof(path), "/dev/shm/%s", e->d_name);
            unlink(path);
        }
    }
    closedir(d);
}

static void node_open(struct node *n, const char *prov, size_t buflen) {
    sweep_stale_regions();
    struct fi_info *hints = fi_allocinfo();
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_MSG;
    hints->mode = FI_CONTEXT;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(prov);
    CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &n->info));
    fi_freeinfo(hints);
    CHECK(fi_fabric(n->info->fabric_attr, &n->fabric, NULL));
    CHECK(fi_domain(n->fabric, n->info, &n->domain, NULL));
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    CHECK(fi_av_open(n->domain, &av_attr, &n->av, NULL));
    struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA, .size = 4096};
    CHECK(fi_cq_open(n->domain, &cq_attr, &n->cq, NULL));
    CHECK(fi_endpoint(n->domain, n->info, &n->ep, NULL));
    CHECK(fi_ep_bind(n->ep, &n->av->fid, 0));
    CHECK(fi_ep_bind(n->ep, &n->cq->fid, FI_TRANSMIT | FI_RECV));
    CHECK(fi_enable(n->ep));
    n->buflen = buflen;
    if (posix_memalign((void **)&n->buf, 4096, buflen)) exit(4);
    memset(n->buf, 1, buflen);
    CHECK(fi_mr_reg(n->domain, n->buf, buflen, FI_WRITE | FI_REMOTE_WRITE, 0, 1, 0, &n->mr, NULL));
    n->desc = fi_mr_desc(n->mr);
}

static struct peer_info node_info(struct node *n) {
    struct peer_info me = {0};
    me.addrlen = sizeof(me.addr);
    CHECK(fi_getname(&n->ep->fid, me.addr, &me.addrlen));
    me.key = fi_mr_key(n->mr);
    me.base = (n->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)n->buf : 0;
    return me;
}

static void node_connect(struct node *n, int fd) {
    struct peer_info me = node_info(n);
    xfer(fd, &me, sizeof(me), 1);
    xfer(fd, &n->remote, sizeof(n->remote), 0);
    if (fi_av_insert(n->av, n->remote.addr, 1, &n->peer, 0, NULL) != 1) {
        fprintf(stderr, "fi_av_insert failed\n");
        exit(2);
    }
}

/* Poll until at least one completion; returns (tx done, remote data seen) counts. */
/* Counts the CQ's completions: imms received (rx) and writes done (tx). ``out``, where given:
 * a fan initiator's writes outstanding per target, whose context is the target + 1. */
static void poll_cq_out(struct node *n, long *out, long *tx, long *rx) {
    struct fi_cq_data_entry e[64];
    ssize_t got = fi_cq_read(n->cq, e, 64);
    if (got == -FI_EAGAIN) return;
    if (got < 0) {
        struct fi_cq_err_entry err = {0};
        fi_cq_readerr(n->cq, &err, 0);
        fprintf(stderr, "cq error: %s\n", fi_strerror(err.err));
        exit(2);
    }
    for (ssize_t i = 0; i < got; i++) {
        if (e[i].flags & FI_REMOTE_CQ_DATA) {
            (*rx)++;
        } else {
            long k = (long)(intptr_t)e[i].op_context - 1;
            if (out && k >= 0) out[k]--;
            (*tx)++;
        }
    }
}

static void poll_cq(struct node *n, long *tx, long *rx) { poll_cq_out(n, NULL, tx, rx); }

/* -d: writes complete on delivery (FI_DELIVERY_COMPLETE), the semantics fabric gives a
 * Transfer; the default is the provider's own (transmit complete). */
static int delivery_complete = 0;
/* -a: a write counts as done (for the window and the time) once the target's acknowledgement
 * covers it: a message (fi_inject, its count of remote CQ data so far) the target sends after
 * a poll that brought its count -A N (default 1) or more past its last acknowledgement, or to
 * the end. The writes themselves go as without -d. What confirming writes costs when the
 * target's software does it instead of the provider (FI_DELIVERY_COMPLETE), as an engine
 * that acknowledged writes itself would (docs/backends/efa.md). Pairs only, bandwidth only. */
static int target_acks = 0;
static long ack_every = 1;
static size_t span = 0; /* -b: bytes the writes cycle through (0: offset 0 only) */

static size_t slot_offset(const struct node *n, size_t size, uint64_t i) {
    size_t slots = size ? n->buflen / size : 1;
    return span && slots ? (size_t)(i % slots) * size : 0;
}

/* One write with remote CQ data from local offset lo to offset ro of ``remote`` (at ``peer``). */
static ssize_t post_write_ctx(struct node *n, size_t size, uint64_t data, fi_addr_t peer,
                              const struct peer_info *remote, size_t lo, size_t ro, void *context) {
    if (!delivery_complete)
        return fi_writedata(n->ep, n->buf + lo, size, n->desc, data, peer, remote->base + ro, remote->key, context);
    struct iovec iov = {.iov_base = n->buf + lo, .iov_len = size};
    struct fi_rma_iov rma = {.addr = remote->base + ro, .len = size, .key = remote->key};
    void *desc = n->desc;
    struct fi_msg_rma msg = {
        .msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = peer,
        .rma_iov = &rma, .rma_iov_count = 1, .context = context, .data = data};
    return fi_writemsg(n->ep, &msg, FI_COMPLETION | FI_REMOTE_CQ_DATA | (size ? FI_DELIVERY_COMPLETE : 0));
}

static ssize_t post_write_to(struct node *n, size_t size, uint64_t data, fi_addr_t peer,
                             const struct peer_info *remote, size_t lo, size_t ro) {
    return post_write_ctx(n, size, data, peer, remote, lo, ro, NULL);
}

/* -W: at most this many writes outstanding per target in a fan (0: the window -w, shared). */
static int per_target = 0;


/* post_write_to, polling the CQ while the provider answers EAGAIN. */
static void write_imm_to(struct node *n, size_t size, uint64_t data, fi_addr_t peer, const struct peer_info *remote,
                         size_t lo, size_t ro, long *tx, long *rx) {
    for (;;) {
        ssize_t rc = post_write_to(n, size, data, peer, remote, lo, ro);
        if (rc == 0) return;
        if (rc != -FI_EAGAIN) CHECK(rc);
        poll_cq(n, tx, rx);
    }
}

/* A pair's write i: slot i of both buffers (offset 0 without -b). */
static void write_imm(struct node *n, size_t size, uint64_t data, long *tx, long *rx) {
    size_t off = slot_offset(n, size, data);
    write_imm_to(n, size, data, n->peer, &n->remote, off, off, tx, rx);
}

enum { CMD_BW = 1, CMD_PING = 2, CMD_QUIT = 3 };
struct cmd {
    int op;
    long count;
    size_t size;
};

static void target(struct node *n, int fd) {
    for (;;) {
        struct cmd c;
        xfer(fd, &c, sizeof(c), 0);
        if (c.op == CMD_QUIT) return;
        long tx = 0, rx = 0, sent = 0;
        if (c.op == CMD_BW && target_acks) {
            long acked = 0;
            while (acked < c.count) {
                poll_cq(n, &tx, &rx);
                if (rx > acked && (rx - acked >= ack_every || rx == c.count)) {
                    uint64_t v = (uint64_t)rx;
                    ssize_t rc;
                    while ((rc = fi_inject(n->ep, &v, sizeof(v), n->peer)) == -FI_EAGAIN) poll_cq(n, &tx, &rx);
                    CHECK(rc);
                    acked = rx;
                }
            }
        } else if (c.op == CMD_BW) {
            while (rx < c.count) poll_cq(n, &tx, &rx);
        } else {
            while (sent < c.count) { /* echo every imm with one of our own */
                long before = rx;
                while (rx == before) poll_cq(n, &tx, &rx);
                write_imm(n, c.size, (uint64_t)sent, &tx, &rx);
                sent++;
            }
            while (tx < sent) poll_cq(n, &tx, &rx);
        }
        xfer(fd, &rx, sizeof(rx), 1);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int k) {
    qsort(v, (size_t)k, sizeof(double), cmp_double);
    return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}

/* --- fan: T initiators -> I targets ------------------------------------------------------- */
struct report {
    double t_start, t_end;
    long count;
};

static int initiator_nice = 0; /* -N */

static void be_initiator(void) {
    if (initiator_nice && setpriority(PRIO_PROCESS, 0, initiator_nice)) {
        perror("setpriority");
        exit(2);
    }
}

static void fan_child(int fd, const char *prov, size_t buflen, int initiator, int me, int T, int I, int window) {
    struct node n = {0};
    if (initiator) be_initiator();
    node_open(&n, prov, buflen);
    struct peer_info mine = node_info(&n);
    xfer(fd, &mine, sizeof(mine), 1);
    int others = initiator ? I : T;
    struct peer_info *peers = calloc((size_t)others, sizeof(*peers));
    fi_addr_t *addrs = calloc((size_t)others, sizeof(*addrs));
    xfer(fd, peers, sizeof(*peers) * (size_t)others, 0);
    for (int k = 0; k < others; k++) {
        if (fi_av_insert(n.av, peers[k].addr, 1, &addrs[k], 0, NULL) != 1) {
            fprintf(stderr, "fi_av_insert failed\n");
            exit(2);
        }
    }
    for (;;) {
        struct cmd c;
        xfer(fd, &c, sizeof(c), 0);
        if (c.op == CMD_QUIT) break;
        struct report r = {0};
        long tx = 0, rx = 0;
        if (!initiator) { /* count every initiator's imms */
            while (rx < c.count) poll_cq(&n, &tx, &rx);
            r.t_end = now_s();
            r.count = rx;
        } else if (per_target > 0) { /* round robin over the targets that have room */
            long *out = calloc((size_t)I, sizeof(long)), *sent = calloc((size_t)I, sizeof(long));
            long posted = 0;
            int k = 0;
            r.t_start = now_s();
            while (posted < c.count) {
                int tried = 0;
                while (tried < I && (out[k] >= per_target || sent[k] >= c.count / I + (k < c.count % I))) {
                    k = (k + 1) % I;
                    tried++;
                }
                if (tried == I) {
                    poll_cq_out(&n, out, &tx, &rx);
                    continue;
                }
                uint64_t there = (uint64_t)sent[k] * (uint64_t)T + (uint64_t)me;
                for (;;) {
                    ssize_t rc = post_write_ctx(&n, c.size, (uint64_t)posted, addrs[k], &peers[k],
                                                slot_offset(&n, c.size, (uint64_t)posted),
                                                slot_offset(&n, c.size, there), (void *)(intptr_t)(k + 1));
                    if (rc == 0) break;
                    if (rc != -FI_EAGAIN) CHECK(rc);
                    poll_cq_out(&n, out, &tx, &rx);
                }
                out[k]++;
                sent[k]++;
                posted++;
                k = (k + 1) % I;
            }
            while (tx < c.count) poll_cq_out(&n, out, &tx, &rx);
            r.t_end = now_s();
            r.count = tx;
            free(out);
            free(sent);
        } else {
            long posted = 0;
            r.t_start = now_s();
            while (posted < c.count) {
                while (posted - tx < window && posted < c.count) {
                    int k = (int)(posted % I);
                    /* this initiator's own slots at each target, cycling through its buffer */
                    uint64_t there = (uint64_t)(posted / I) * (uint64_t)T + (uint64_t)me;
                    write_imm_to(&n, c.size, (uint64_t)posted, addrs[k], &peers[k],
                                 slot_offset(&n, c.size, (uint64_t)posted), slot_offset(&n, c.size, there), &tx, &rx);
                    posted++;
                }
                poll_cq(&n, &tx, &rx);
            }
            while (tx < c.count) poll_cq(&n, &tx, &rx);
            r.t_end = now_s();
            r.count = tx;
        }
        xfer(fd, &r, sizeof(r), 1);
    }
    free(peers);
    free(addrs);
}

static int run_fan(const char *prov, const char *sizes, int T, int I, int window, int reps, size_t per_initiator,
                   size_t buflen) {
    int P = T + I;
    int *fds = calloc((size_t)P, sizeof(int));
    pid_t *pids = calloc((size_t)P, sizeof(pid_t));
    for (int i = 0; i < P; i++) { /* 0..T-1 initiators, T..P-1 targets */
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return 5;
        pids[i] = fork();
        if (pids[i] == 0) {
            for (int j = 0; j < i; j++) close(fds[j]);
            close(sv[0]);
            fan_child(sv[1], prov, buflen, i < T, i < T ? i : i - T, T, I, window);
            _exit(0);
        }
        close(sv[1]);
        fds[i] = sv[0];
    }
    struct peer_info *infos = calloc((size_t)P, sizeof(*infos));
    for (int i = 0; i < P; i++) xfer(fds[i], &infos[i], sizeof(infos[i]), 0);
    for (int i = 0; i < T; i++) xfer(fds[i], infos + T, sizeof(*infos) * (size_t)I, 1);
    for (int i = T; i < P; i++) xfer(fds[i], infos, sizeof(*infos) * (size_t)T, 1);
    for (const char *p = sizes; *p;) {
        size_t size = strtoull(p, (char **)&p, 10);
        if (*p == ',') p++;
        if (!size) continue;
        long count = (long)(per_initiator / size);
        count -= count % I; /* the same writes to every target */
        if (count < I) count = I;
        double secs[64];
        double first_start = 1e300, last_end = 0;
        int k = reps < 64 ? reps : 64;
        for (int r = 0; r < k; r++) {
            struct cmd to_target = {CMD_BW, count / I * T, size}, to_initiator = {CMD_BW, count, size};
            for (int i = T; i < P; i++) xfer(fds[i], &to_target, sizeof(to_target), 1);
            for (int i = 0; i < T; i++) xfer(fds[i], &to_initiator, sizeof(to_initiator), 1);
            double t0 = 1e300, t1 = 0;
            for (int i = 0; i < P; i++) {
                struct report rep;
                xfer(fds[i], &rep, sizeof(rep), 0);
                long want = i < T ? count : count / I * T;
                if (rep.count != want) {
                    fprintf(stderr, "%s %d counted %ld of %ld\n", i < T ? "initiator" : "target", i, rep.count, want);
                    return 6;
                }
                if (i < T && rep.t_start < t0) t0 = rep.t_start;
                if (rep.t_end > t1) t1 = rep.t_end;
            }
            secs[r] = t1 - t0;
            if (t0 < first_start) first_start = t0;
            if (t1 > last_end) last_end = t1;
        }
        double t = median(secs, k);
        double bytes = (double)size * (double)count * (double)T;
        printf("{\"kind\": \"fan_bandwidth\", \"provider\": \"%s\", \"initiators\": %d, \"targets\": %d, \"size\": %zu, "
               "\"span\": %zu, \"window\": %d, \"per_target\": %d, \"writes_per_initiator\": %ld, \"reps\": %d, "
               "\"seconds_median\": %.6f, \"gbytes_per_s\": %.4f, \"t_start\": %.6f, \"t_end\": %.6f, "
               "\"initiator_nice\": %d}\n",
               prov, T, I, size, span, window, per_target, count, k, t, bytes / t / 1e9, first_start, last_end,
               initiator_nice);
        fflush(stdout);
    }
    struct cmd quit = {CMD_QUIT, 0, 0};
    int failed = 0;
    for (int i = 0; i < P; i++) {
        xfer(fds[i], &quit, sizeof(quit), 1);
        int status = 0;
        waitpid(pids[i], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status)) failed = 7;
        close(fds[i]);
    }
    free(infos);
    free(fds);
    free(pids);
    return failed;
}

int main(int argc, char **argv) {
    const char *prov = "shm", *sizes = "8,64,512,4096,32768,65536,262144,1048576,4194304,16777216";
    int window = 64, reps = 5, ping_iters = 20000, fan_t = 0, fan_i = 0;
    size_t per_bytes = 0; /* -n; 0: about 1 GiB per repetition (a pair), 256 MiB per initiator (a fan) */
    int opt;
    while ((opt = getopt(argc, argv, "p:s:w:W:r:l:daA:b:f:n:N:")) != -1) {
        switch (opt) {
        case 'p': prov = optarg; break;
        case 'd': delivery_complete = 1; break;
        case 'a': target_acks = 1; break;
        case 'A': ack_every = atol(optarg); break;
        case 's': sizes = optarg; break;
        case 'w': window = atoi(optarg); break;
        case 'W': per_target = atoi(optarg); break;
        case 'r': reps = atoi(optarg); break;
        case 'l': ping_iters = atoi(optarg); break;
        case 'b': span = strtoull(optarg, NULL, 10); break;
        case 'f':
            if (sscanf(optarg, "%d:%d", &fan_t, &fan_i) != 2 || fan_t < 1 || fan_i < 1 || fan_t + fan_i > 512) {
                fprintf(stderr, "-f wants INITIATORS:TARGETS, e.g. 4:2\n");
                return 1;
            }
            break;
        case 'n': per_bytes = strtoull(optarg, NULL, 10); break;
        case 'N':
            initiator_nice = atoi(optarg);
            if (initiator_nice < 0 || initiator_nice > 19) {
                fprintf(stderr, "-N wants a nice value from 0 to 19\n");
                return 1;
            }
            break;
        default:
            fprintf(stderr,
                    "usage: %s [-p provider] [-s sizes] [-w window] [-r reps] [-l pingpong iters] [-d] [-a] [-A acks every N] [-b span] [-n bytes per rep] [-N nice]\n"
                    "       %s -f INITIATORS:TARGETS [-n bytes per initiator] [-p provider] [-s sizes] [-w window | -W per target] [-r reps] [-b span] [-N nice]\n",
                    argv[0], argv[0]);
            return 1;
        }
    }
    size_t maxsize = 0;
    for (const char *p = sizes; *p;) {
        size_t s = strtoull(p, (char **)&p, 10);
        if (s > maxsize) maxsize = s;
        if (*p == ',') p++;
    }
    if (span > maxsize) maxsize = span;
    if (fan_t) return run_fan(prov, sizes, fan_t, fan_i, window, reps, per_bytes ? per_bytes : 256UL << 20, maxsize);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return 5;
    pid_t child = fork();
    struct node n = {0};
    if (child == 0) {
        close(sv[0]);
        node_open(&n, prov, maxsize);
        node_connect(&n, sv[1]);
        target(&n, sv[1]);
        return 0;
    }
    close(sv[1]);
    be_initiator(); /* after the fork: the target keeps the caller's nice */
    int fd = sv[0];
    node_open(&n, prov, maxsize);
    node_connect(&n, fd);

    enum { kAckBufs = 64 };
    static uint64_t ackbuf[kAckBufs][8];
    struct fid_mr *ack_mr = NULL;
    void *ack_desc = NULL;
    struct fi_context ack_ctx[kAckBufs];
    if (target_acks) {
        CHECK(fi_mr_reg(n.domain, ackbuf, sizeof(ackbuf), FI_RECV, 0, 2, 0, &ack_mr, NULL));
        ack_desc = fi_mr_desc(ack_mr);
        for (int i = 0; i < kAckBufs; i++) CHECK(fi_recv(n.ep, ackbuf[i], sizeof(ackbuf[i]), ack_desc, n.peer, &ack_ctx[i]));
    }
    for (const char *p = sizes; *p;) {
        size_t size = strtoull(p, (char **)&p, 10);
        if (*p == ',') p++;
        long count;
        if (per_bytes) { /* -n: this many bytes per repetition */
            count = (long)(per_bytes / (size ? size : 1));
            if (count < 1) count = 1;
        } else {
            count = (long)((1UL << 30) / (size ? size : 1));
            if (count < 2000) count = 2000;
            if (count > 200000) count = 200000;
        }
        double secs[64];
        double first_start = now_s();
        for (int r = 0; r < reps && r < 64; r++) {
            struct cmd c = {CMD_BW, count, size};
            xfer(fd, &c, sizeof(c), 1);
            long tx = 0, rx = 0, posted = 0, seen = 0;
            double t0 = now_s();
            if (target_acks) {
                long acked = 0;
                while (acked < count || tx < count) {
                    while (posted - acked < window && posted < count) {
                        size_t off = slot_offset(&n, size, (uint64_t)posted);
                        ssize_t rc = post_write_to(&n, size, (uint64_t)posted, n.peer, &n.remote, off, off);
                        if (rc == -FI_EAGAIN) break;
                        CHECK(rc);
                        posted++;
                    }
                    struct fi_cq_data_entry e[64];
                    ssize_t got = fi_cq_read(n.cq, e, 64);
                    if (got == -FI_EAGAIN) continue;
                    if (got < 0) { fprintf(stderr, "cq error\n"); return 2; }
                    for (ssize_t i = 0; i < got; i++) {
                        if (e[i].flags & FI_RECV) {
                            int k = (int)((struct fi_context *)e[i].op_context - ack_ctx);
                            uint64_t v = ackbuf[k][0];
                            if ((long)v > acked) acked = (long)v;
                            CHECK(fi_recv(n.ep, ackbuf[k], sizeof(ackbuf[k]), ack_desc, n.peer, &ack_ctx[k]));
                        } else {
                            tx++;
                        }
                    }
                }
            }
            while (posted < count) {
                while (posted - tx < window && posted < count) {
                    write_imm(&n, size, (uint64_t)posted, &tx, &rx);
                    posted++;
                }
                poll_cq(&n, &tx, &rx);
            }
            while (tx < count) poll_cq(&n, &tx, &rx);
            xfer(fd, &seen, sizeof(seen), 0); /* the target has counted every imm */
            secs[r] = now_s() - t0;
            if (seen != count) {
                fprintf(stderr, "target counted %ld of %ld\n", seen, count);
                return 6;
            }
        }
        double last_end = now_s();
        double t = median(secs, reps < 64 ? reps : 64);
        /* t_start/t_end: CLOCK_MONOTONIC (one clock for every process of the host), so several
         * copies run at once give their aggregate: all their bytes over the union of their times */
        printf("{\"kind\": \"bandwidth\", \"provider\": \"%s\", \"size\": %zu, \"span\": %zu, \"window\": %d, \"writes\": %ld, "
               "\"reps\": %d, \"seconds_median\": %.6f, \"gbytes_per_s\": %.4f, \"mwrites_per_s\": %.4f, "
               "\"t_start\": %.6f, \"t_end\": %.6f, \"confirm\": \"%s\", \"acks_every\": %ld}\n",
               prov, size, span, window, count, reps, t, (double)size * (double)count / t / 1e9, (double)count / t / 1e6,
               first_start, last_end,
               target_acks ? "target_acks" : delivery_complete ? "delivery_complete" : "transmit_complete",
               target_acks ? ack_every : 0L);
        fflush(stdout);
    }

    /* imm round trip: 8-byte write with data, the target answers with one of its own (-l 0: skipped) */
    if (ping_iters > 0) {
        struct cmd c = {CMD_PING, ping_iters, 8};
        xfer(fd, &c, sizeof(c), 1);
        double *rtt = malloc(sizeof(double) * (size_t)ping_iters);
        long tx = 0, rx = 0, seen = 0;
        for (long i = 0; i < ping_iters; i++) {
            double t0 = now_s();
            long before = rx;
            write_imm(&n, 8, (uint64_t)i, &tx, &rx);
            while (rx == before) poll_cq(&n, &tx, &rx);
            rtt[i] = now_s() - t0;
        }
        while (tx < ping_iters) poll_cq(&n, &tx, &rx);
        xfer(fd, &seen, sizeof(seen), 0);
        double med = median(rtt, ping_iters);
        double p99 = rtt[(long)(0.99 * (ping_iters - 1))];
        printf("{\"kind\": \"imm_round_trip\", \"provider\": \"%s\", \"iters\": %d, \"rtt_us_p50\": %.3f, "
               "\"rtt_us_p99\": %.3f}\n",
               prov, ping_iters, med * 1e6, p99 * 1e6);
        free(rtt);
    }
    struct cmd quit = {CMD_QUIT, 0, 0};
    xfer(fd, &quit, sizeof(quit), 1);
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 7;
}
