/* PID 1 of one emulated TPU worker, once _worker_init.py has built the worker's view and exec'd this.

   What it does, for as long as the worker lives:
   - reaps every process of the worker's PID namespace (orphans re-parent to PID 1, as on a VM);
   - when the startup script (started by _worker_init.py, pid given) ends: appends its exit status to
     startup.log and writes startup.status, as _worker_init.py's Python init did;
   - listens on ADDRESS:PORT and starts `sshd -i` for each connection, as inetd does: the worker has no sshd
     of its own while nobody is connected;
   - a private VM's (one without an external address) takes a connection only from the networks its file
     `ssh-from` lists ("A.B.C.D/N" words: its own network and IAP's stand-in range), and resets any other at
     once; without the file (a public VM) it takes every connection. The file is read at each connection, so
     a VM that gains or loses its external address follows at its next one;
   - SIGUSR2 closes the listener (the emulator's kill-sshd: sessions live on), SIGUSR1 opens it again.

   Usage: tpurun-worker-init VIEW ADDRESS PORT SCRIPT_PID HOST_DIR
   (VIEW: the worker's directory as the worker sees it; HOST_DIR: the same directory on the host, on the
   command line only so that the emulator finds a crashed emulator's workers by their state dir).
   Built by hosts.py with the C compiler when the emulator starts (stdlib C only). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int wake[2];
static volatile sig_atomic_t want_listen = 1;
static const char *view, *address;
static int port;
static char path_buf[4096];

static const char *at(const char *name) {
    snprintf(path_buf, sizeof path_buf, "%s/%s", view, name);
    return path_buf;
}

static void say(const char *msg, int err) {
    char when[32];
    time_t now = time(NULL);
    strftime(when, sizeof when, "%H:%M:%S", localtime(&now));
    if (err)
        fprintf(stderr, "[init %s] %s: %s\n", when, msg, strerror(err));
    else
        fprintf(stderr, "[init %s] %s\n", when, msg);
    fflush(stderr);
}

static void on_signal(int sig) {
    int saved = errno;
    if (sig == SIGUSR1)
        want_listen = 1;
    else if (sig == SIGUSR2)
        want_listen = 0;
    if (write(wake[1], "x", 1) < 0) { /* the pipe is full: a wake-up is pending anyway */
    }
    errno = saved;
}

static int open_listener(void) {
    struct sockaddr_in sa;
    int one = 1, fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((unsigned short)port);
    if (inet_pton(AF_INET, address, &sa.sin_addr) != 1) {
        close(fd);
        errno = EINVAL;
        return -1;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 4096) < 0) {
        int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    /* the emulator waits for this file, not for a connection (each would start an sshd) */
    int mark = open(at("listening"), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (mark >= 0)
        close(mark);
    return fd;
}

static void close_listener(int *fd) {
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
        unlink(at("listening"));
    }
}

/* Whether PEER may reach this worker's sshd (see the top: `ssh-from`). */
static int admitted(const struct sockaddr_in *peer) {
    FILE *f = fopen(at("ssh-from"), "re");
    if (!f)
        return 1;
    unsigned a, b, c, d, bits;
    int ok = 0;
    uint32_t from = ntohl(peer->sin_addr.s_addr);
    while (!ok && fscanf(f, " %u.%u.%u.%u/%u", &a, &b, &c, &d, &bits) == 5) {
        uint32_t net = a << 24 | b << 16 | c << 8 | d, mask = bits ? ~0u << (32 - (bits > 32 ? 32 : bits)) : 0;
        ok = ((from ^ net) & mask) == 0;
    }
    fclose(f);
    return ok;
}

/* One connection's sshd, inside this worker's namespaces: the connection on its stdin and stdout. */
static void start_sshd(int conn) {
    pid_t pid = fork();
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGCHLD, SIG_DFL);
        signal(SIGUSR1, SIG_DFL);
        signal(SIGUSR2, SIG_DFL);
        signal(SIGPIPE, SIG_DFL);
        setsid();
        int log = open(at("sshd.log"), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        if (dup2(conn, 0) < 0 || dup2(conn, 1) < 0 || (log >= 0 && dup2(log, 2) < 0))
            _exit(127);
        char config[4096];
        snprintf(config, sizeof config, "%s/sshd_config", view);
        char *argv[] = {"/usr/sbin/sshd", "-i", "-e", "-f", config, NULL};
        char *envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", NULL};
        execve(argv[0], argv, envp);
        _exit(127);
    }
    if (pid < 0)
        say("cannot start sshd", errno);
}

static void script_done(int status) {
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    FILE *f = fopen(at("startup.log"), "a");
    if (f) {
        fprintf(f, "--- startup-script finished with exit status %d\n", code);
        fclose(f);
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s/startup.status.tmp", view);
    f = fopen(tmp, "w");
    if (f) {
        fprintf(f, "%d\n", code);
        fclose(f);
        rename(tmp, at("startup.status"));
    }
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: tpurun-worker-init VIEW ADDRESS PORT SCRIPT_PID HOST_DIR\n");
        return 2;
    }
    view = argv[1];
    address = argv[2];
    port = atoi(argv[3]);
    pid_t script = (pid_t)atoi(argv[4]);
    if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) < 0)
        return 3;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGCHLD, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
    sigaction(SIGUSR2, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    int listener = open_listener();
    if (listener < 0) {
        say("cannot listen for ssh", errno);
        return 4;
    }
    for (;;) {
        int status;
        pid_t pid;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
            if (pid == script) {
                script = 0;
                script_done(status);
            }
        }
        if (want_listen && listener < 0) {
            listener = open_listener();
            if (listener < 0)
                say("cannot listen for ssh", errno);
        } else if (!want_listen) {
            close_listener(&listener);
        }
        struct pollfd fds[2] = {{wake[0], POLLIN, 0}, {listener, POLLIN, 0}};
        if (poll(fds, listener >= 0 ? 2 : 1, -1) < 0 && errno != EINTR)
            say("poll", errno);
        if (fds[0].revents & POLLIN) {
            char drain[64];
            while (read(wake[0], drain, sizeof drain) > 0) {
            }
        }
        if (listener >= 0 && (fds[1].revents & POLLIN)) {
            struct sockaddr_in peer;
            socklen_t len = sizeof peer;
            int conn = accept4(listener, (struct sockaddr *)&peer, &len, SOCK_CLOEXEC);
            if (conn >= 0) {
                if (admitted(&peer)) {
                    start_sshd(conn);
                } else { /* a reset, not an orderly end: the client is told it was refused, not that sshd left */
                    struct linger now = {1, 0};
                    setsockopt(conn, SOL_SOCKET, SO_LINGER, &now, sizeof now);
                }
                close(conn);
            } else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
                say("accept", errno);
            }
        }
    }
}
