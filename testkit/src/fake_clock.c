/*
 * A wall clock of the test's choosing, preloaded (LD_PRELOAD) into a child process: the
 * realtime clock (clock_gettime(CLOCK_REALTIME*), gettimeofday(), time()) reads the real
 * time plus an offset in seconds, "+N" or "-N" (fractions allowed), read from the file
 * named by $TOLLGATE_FAKE_CLOCK at every call, so a test moves the clock of every process
 * reading that file at once, and they all agree. "@N" instead stops the clock at N
 * seconds since the epoch (fractions allowed): every read gives that instant until the
 * file changes. Other clocks (monotonic, CPU) are left alone: timers and timeouts run in
 * real time.
 *
 * Why not libfaketime: Debian's redis-server is linked with jemalloc, whose start-up reads
 * the clock before libfaketime's own start-up (which allocates) can finish; libfaketime
 * then returns errors and redis-server crashes (libfaketime issue #130). This has no
 * start-up, allocates nothing and resolves no symbols: raw system calls only.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define NS 1000000000LL

/* The offset in ns; or, when *still is set, the instant the clock stands at. */
static long long offset_ns(int *still) {
    *still = 0;
    const char *path = getenv("TOLLGATE_FAKE_CLOCK");
    if (path == NULL) return 0;
    int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    char buf[64];
    long n = syscall(SYS_read, fd, buf, sizeof buf - 1);
    syscall(SYS_close, fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    const char *p = buf;
    int negative = 0;
    if (*p == '@') {
        *still = 1;
        p++;
    } else if (*p == '+' || *p == '-') {
        negative = *p++ == '-';
    }
    long long secs = 0, frac = 0, scale = NS;
    while (*p >= '0' && *p <= '9') secs = secs * 10 + (*p++ - '0');
    if (*p == '.') {
        for (p++; *p >= '0' && *p <= '9'; p++) {
            if (scale > 1) {
                scale /= 10;
                frac += (*p - '0') * scale;
            }
        }
    }
    long long ns = secs * NS + frac;
    return negative ? -ns : ns;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    int r = (int)syscall(SYS_clock_gettime, clock, ts);
    if (r == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        int still;
        long long offset = offset_ns(&still);
        long long t = still ? offset : (long long)ts->tv_sec * NS + ts->tv_nsec + offset;
        ts->tv_sec = (time_t)(t / NS);
        ts->tv_nsec = (long)(t % NS);
        if (ts->tv_nsec < 0) {
            ts->tv_nsec += NS;
            ts->tv_sec -= 1;
        }
    }
    return r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return (time_t)-1;
    if (t != NULL) *t = ts.tv_sec;
    return ts.tv_sec;
}
