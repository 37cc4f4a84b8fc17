/* The gvisor box's init, compiled: relay/box/gvisor_init.py's duties in a static binary.
 *
 * Why a second implementation: every exec in gVisor's Sentry is costly here, and the Python init paid
 * ~100 ms of each gvisor launch (python3's start, then ctypes, socket and threading) against ~20 ms for
 * this one (invoke bench's gvisor rows). relay/host/native_init.py builds it on first use with the host's
 * cc (`cc -O2 -static -pthread`), keeps it in the cache dir (trusted only when ours alone) and falls back
 * to the Python init where no static build is possible; HIVE_RELAY_GVISOR_INIT=python asks for that one.
 * Both are held to the same tests (tests/test_gvisor.py runs its behaviour tests on each).
 *
 * Usage: gvisor-init SOCKET HOST:PORT BPF|- -- ARGV...
 * - binds HOST:PORT in gVisor's own network stack (`-`: no network) and relays each connection to the
 *   proxy's unix socket SOCKET, bound into the box at a fixed path (one thread per direction), whose
 *   directory it opens before the agent exists and connects relative to (see main);
 * - reads and checks the agent's seccomp program BPF (struct sock_filter[], at most 1 MiB) before the
 *   agent exists: a missing or malformed one stops the box (exit 3), never runs it open;
 * - vfork()s the agent (no copy of this process in the Sentry); only the child sets every signal to
 *   its default (SIGPIPE and SIGXFSZ too, as a fresh exec would), empties its mask, sets no_new_privs
 *   and loads the filter, then execs; this init keeps AF_UNIX for the relay and runs nothing else;
 * - is not dumpable (the agent runs as the same uid: /proc/1/mem would let it write code into the one
 *   process its filter does not hold), ignores the keyboard's signals, passes SIGTERM and SIGHUP on;
 * - reaps every child as the box's pid 1 and exits with the agent's status (a signal death as 128+N).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHUNK (1 << 18)
#define MAX_BPF (1 << 20)
#define STACK (64 << 10)
#define UNIX_BUFFER (4 << 20)

static const int keyboard[] = {SIGINT, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU};
static volatile pid_t agent;
static struct sockaddr_un up_addr;
static char bpf_data[MAX_BPF];

/* One direction of a relayed connection; a half-close is passed on as one. */
static void pump(int src, int dst) {
    char *buf = malloc(CHUNK);
    if (buf) {
        for (;;) {
            ssize_t n = read(src, buf, CHUNK);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            for (ssize_t off = 0; off < n;) {
                ssize_t w = send(dst, buf + off, (size_t)(n - off), MSG_NOSIGNAL);
                if (w < 0) {
                    if (errno == EINTR) continue;
                    goto out;
                }
                off += w;
            }
        }
    }
out:
    free(buf);
    shutdown(dst, SHUT_WR);
}

struct pair { int client, up; };

static void *back(void *p) {
    struct pair *x = p;
    pump(x->up, x->client);
    return NULL;
}

static void thread_attr(pthread_attr_t *at, int detached) {
    pthread_attr_init(at);
    pthread_attr_setstacksize(at, STACK);
    if (detached) pthread_attr_setdetachstate(at, PTHREAD_CREATE_DETACHED);
}

static void *relay(void *p) {
    struct pair x = {(int)(long)p, -1};
    x.up = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (x.up >= 0) { /* each read and write here is a host call of the Sentry's: fewer, larger ones */
        int big = UNIX_BUFFER;
        setsockopt(x.up, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
        setsockopt(x.up, SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    }
    if (x.up < 0 || connect(x.up, (struct sockaddr *)&up_addr, sizeof up_addr) < 0) {
        if (x.up >= 0) close(x.up);
        close(x.client);
        return NULL;
    }
    pthread_t t;
    pthread_attr_t at;
    thread_attr(&at, 0);
    int ok = pthread_create(&t, &at, back, &x) == 0;
    pump(x.client, x.up);
    if (ok) pthread_join(t, NULL);
    close(x.client);
    close(x.up);
    return NULL;
}

static void *serve(void *p) {
    int listener = (int)(long)p;
    pthread_attr_t at;
    thread_attr(&at, 1);
    for (;;) {
        int c = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) continue;
        pthread_t t;
        if (pthread_create(&t, &at, relay, (void *)(long)c)) close(c);
    }
    return NULL;
}

static void forward(int sig) {
    if (agent > 0) kill(agent, sig);
}

static int listen_on(const char *where) {
    char host[64];
    const char *colon = strrchr(where, ':');
    if (!colon || colon == where || colon - where >= (long)sizeof host) return -1;
    memcpy(host, where, (size_t)(colon - where));
    host[colon - where] = 0;
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (*end || port <= 0 || port > 65535) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
    int one = 1, l;
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1 || (l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0)
        return -1;
    if (setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) || bind(l, (struct sockaddr *)&a, sizeof a) ||
        listen(l, 1024)) {
        close(l);
        return -1;
    }
    return l;
}

int main(int argc, char **argv) {
    if (argc < 6 || strcmp(argv[4], "--") != 0) {
        fputs("usage: gvisor-init SOCKET HOST:PORT BPF|- -- ARGV...\n", stderr);
        return 2;
    }
    const char *path = argv[1], *where = argv[2], *bpf = argv[3];
    char **command = argv + 5;
    int listener = -1, held = -1;
    if (strcmp(path, "-") != 0) {
        /* The socket's directory, opened before the agent exists; every connect() is made relative to it
         * (this init's cwd, below). /run is the box's to write: an agent that renamed the directory away
         * and linked another host socket in its place must not steer the relay there. */
        const char *slash = strrchr(path, '/');
        char dir[4096];
        if (!slash || slash[1] == 0 || (size_t)(slash - path) >= sizeof dir) return 2;
        memcpy(dir, path, (size_t)(slash - path));
        dir[slash - path] = 0;
        held = open(slash == path ? "/" : dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (held < 0) {
            fprintf(stderr, "hive-relay: cannot open %s in the gvisor box: %s\n", dir, strerror(errno));
            return 3;
        }
        if (strlen(slash + 1) >= sizeof up_addr.sun_path) return 2;
        up_addr.sun_family = AF_UNIX;
        strcpy(up_addr.sun_path, slash + 1);
        if ((listener = listen_on(where)) < 0) {
            fprintf(stderr, "hive-relay: cannot listen on %s in the gvisor box: %s\n", where, strerror(errno));
            return 3;
        }
    }
    struct sock_fprog prog = {0, NULL};
    if (strcmp(bpf, "-") != 0) {
        int fd = open(bpf, O_RDONLY | O_CLOEXEC);
        ssize_t n = 0, r = 0;
        if (fd >= 0) {
            while (n < MAX_BPF && (r = read(fd, bpf_data + n, (size_t)(MAX_BPF - n))) > 0) n += r;
            close(fd);
        }
        if (fd < 0 || r < 0 || n <= 0 || n % 8 || n >= MAX_BPF) {
            fprintf(stderr, "hive-relay: cannot start %s in the gvisor box: malformed seccomp program %s (%zd bytes)\n",
                    command[0], bpf, fd < 0 ? (ssize_t)-1 : n);
            return 3;
        }
        prog.len = (unsigned short)(n / 8);
        prog.filter = (struct sock_filter *)bpf_data;
    }
    volatile int stage = 0, err = 0; /* written by the vfork child, read here after it exec'd or died */
    pid_t pid = vfork();
    if (pid == 0) {
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        for (int s = 1; s < NSIG; s++) sigaction(s, &dfl, NULL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        if (prog.filter) {
            stage = 1;
            if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) {
                err = errno;
                _exit(3);
            }
            stage = 2;
            if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0)) {
                err = errno;
                _exit(3);
            }
        }
        stage = 3;
        execvp(command[0], command);
        err = errno;
        _exit(127);
    }
    if (pid < 0 || err) {
        int e = pid < 0 ? errno : err;
        const char *what = stage == 1 ? "prctl(PR_SET_NO_NEW_PRIVS): " : stage == 2 ? "prctl(PR_SET_SECCOMP): " : "";
        if (pid > 0) waitpid(pid, NULL, 0);
        fprintf(stderr, "hive-relay: cannot start %s in the gvisor box: %s%s\n", command[0], what, strerror(e));
        return e == ENOENT && stage == 3 ? 127 : 3;
    }
    agent = pid;
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    for (unsigned i = 0; i < sizeof keyboard / sizeof *keyboard; i++) signal(keyboard[i], SIG_IGN);
    struct sigaction fw = {.sa_handler = forward, .sa_flags = SA_RESTART};
    sigaction(SIGTERM, &fw, NULL);
    sigaction(SIGHUP, &fw, NULL);
    if (listener >= 0) {
        if (fchdir(held)) { /* the agent started in its own cwd; this init's connects resolve here */
            fputs("hive-relay: cannot enter the proxy socket's directory in the gvisor box\n", stderr);
            kill(pid, SIGKILL);
            return 3;
        }
        close(held);
        pthread_t t;
        pthread_attr_t at;
        thread_attr(&at, 1);
        if (pthread_create(&t, &at, serve, (void *)(long)listener)) {
            fputs("hive-relay: cannot start the gvisor box's relay\n", stderr);
            kill(pid, SIGKILL);
            return 3;
        }
    }
    for (;;) {
        int status;
        pid_t got = waitpid(-1, &status, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            _exit(0);
        }
        if (got != pid) continue;
        if (WIFEXITED(status)) _exit(WEXITSTATUS(status));
        if (WIFSIGNALED(status)) {
            int sig = WTERMSIG(status);
            signal(sig, SIG_DFL);
            sigset_t s;
            sigemptyset(&s);
            sigaddset(&s, sig);
            pthread_sigmask(SIG_UNBLOCK, &s, NULL);
            kill(getpid(), sig); /* pid 1 of its namespace: ignored there, so the status below */
            _exit(128 + sig);
        }
    }
}
