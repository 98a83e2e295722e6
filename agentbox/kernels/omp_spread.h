/* Keeps an OpenMP team's workers off the CPU of the thread that calls a kernel (the team's master). Include this
 * first: it needs _GNU_SOURCE before any system header.
 *
 * Why: between two agent turns the engine sleeps, and libgomp's worker threads stop spinning and sleep too. The
 * next call wakes them, and Linux often wakes a thread onto the CPU of the thread that woke it: the worker then
 * shares the master's CPU while the master spins at the team's barrier, until load balancing moves one of them
 * a few ms later. On the 2-core Xeon of bench/results/warm, a warm turn's attention at 121k keys on 2 threads
 * took 2.5 ms called back to back and a median of 7.2 ms (p90 8.4) called every 20 ms, with workers pinned
 * away from the master 3.1-3.6 ms (p90 3.4-4.0). OMP_PROC_BIND would pin the master as well: every engine on a
 * machine (the test suite runs several) would pin its main thread to the first core. Here the master stays
 * where the OS puts it; worker t goes to the t-th allowed CPU that is not the master's, and moves again only
 * when the master did. Only for a team of one thread per allowed CPU (the engine's attention on every core):
 * a smaller team may share the machine with others (tensor-parallel ranks take a share of the cores each),
 * whose workers would be pinned to the same first CPUs. Nothing is done where the user set OMP_PROC_BIND. */
#ifndef AB_OMP_SPREAD_H
#define AB_OMP_SPREAD_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <omp.h>
#include <sched.h>

#define SPREAD_MAX_CPUS 1024

static int spread_cpus[SPREAD_MAX_CPUS]; /* the CPUs this process may run on (its affinity when first asked) */
static int spread_n = -1;
static int spread_master = -1; /* the master's CPU the workers were placed for */

static void spread_workers(int threads) {
    if (threads < 2 || omp_get_proc_bind() != omp_proc_bind_false) return;
    if (spread_n < 0) {
        cpu_set_t allowed;
        int n = 0;
        if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
            for (int c = 0; c < CPU_SETSIZE && n < SPREAD_MAX_CPUS; c++)
                if (CPU_ISSET(c, &allowed)) spread_cpus[n++] = c;
        spread_n = n;
    }
    const int master = sched_getcpu();
    if (master < 0 || threads != spread_n) return;
    if (master == spread_master) return; /* placed already: the common case */
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        for (int i = 0, k = 0; t > 0 && i < spread_n; i++) {
            if (spread_cpus[i] == master || ++k != t) continue;
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(spread_cpus[i], &one);
            sched_setaffinity(0, sizeof one, &one); /* this thread only; a refusal leaves it where it was */
            break;
        }
    }
    spread_master = master;
}

#endif
