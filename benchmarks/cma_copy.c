/* How fast the kernel's cross-process copy (CMA: process_vm_readv, what UCX's `cma`
 * transport, the split rendezvous and the shared-memory engine's single-copy mode use)
 * moves bytes on this machine, next to a plain memcpy of the same blocks.
 *
 *   cc -O2 -o /tmp/cma_copy benchmarks/cma_copy.c
 *   taskset -c 0 /tmp/cma_copy BLOCK BLOCKS REPS
 *
 * A child process writes BLOCKS blocks of BLOCK bytes (its own pages, not shared with
 * the parent) and waits; the parent reads every block REPS times with one
 * process_vm_readv each, then copies the same blocks REPS times with memcpy in its own
 * memory. BLOCK x BLOCKS is the footprint (docs/benchmarks.md, "Issue 29, session 13",
 * quotes 64 KiB-4 MiB blocks in 4-64 MiB). Needs ptrace permission over the child
 * (its parent has it under Yama's default). */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s BLOCK BLOCKS REPS\n", argv[0]);
        return 2;
    }
    size_t n = strtoul(argv[1], NULL, 0);
    size_t nb = strtoul(argv[2], NULL, 0);
    long reps = strtol(argv[3], NULL, 0);
    if (n == 0 || nb == 0 || reps <= 0) {
        fprintf(stderr, "BLOCK, BLOCKS and REPS must be positive\n");
        return 2;
    }
    char *src = malloc(n * nb);
    char *dst = malloc(n * nb);
    int ready[2];
    if (src == NULL || dst == NULL || pipe(ready) != 0) {
        perror("setup");
        return 1;
    }
    memset(src, 1, n * nb);
    memset(dst, 0, n * nb);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        memset(src, 2, n * nb); /* (its own pages from here on) */
        char c = 1;
        if (write(ready[1], &c, 1) != 1)
            _exit(1);
        pause();
        _exit(0);
    }
    char c;
    if (read(ready[0], &c, 1) != 1) {
        perror("child");
        return 1;
    }
    double t0 = now();
    for (long r = 0; r < reps; r++) {
        for (size_t b = 0; b < nb; b++) {
            struct iovec local = {dst + b * n, n}, remote = {src + b * n, n};
            if (process_vm_readv(pid, &local, 1, &remote, 1, 0) != (ssize_t)n) {
                perror("process_vm_readv");
                kill(pid, SIGKILL);
                return 1;
            }
        }
    }
    double t1 = now();
    int theirs = dst[0] == 2 && dst[n * nb - 1] == 2; /* (the child's bytes came) */
    for (long r = 0; r < reps; r++)
        for (size_t b = 0; b < nb; b++)
            memcpy(dst + b * n, src + b * n, n);
    double t2 = now();
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    double bytes = (double)n * (double)nb * (double)reps;
    printf("block %zu x %zu (%.1f MiB): process_vm_readv %.2f GB/s, memcpy %.2f GB/s "
           "(the child's bytes read: %s)\n", n, nb, (double)(n * nb) / 1048576.0,
           bytes / (t1 - t0) / 1e9, bytes / (t2 - t1) / 1e9, theirs ? "yes" : "NO");
    return theirs ? 0 : 1;
}
