/* A worker's PAM module for sshd's keyboard-interactive step: the conversation of a program of the emulator's.
 *
 * Google's guest asks OS Login's second factor in a PAM module of its own (guest-oslogin's pam_oslogin_login);
 * the emulator keeps that logic in Python (guest_login.py's TWO_FACTOR_SCRIPT) and this module only carries its
 * conversation: it runs the program its arguments name (the login name added last), passes every message the
 * program writes on its stdout to PAM's conversation (sshd sends them as keyboard-interactive prompts) and writes
 * each answer back on the program's stdin. The program's exit status decides: 0 lets the user in.
 *
 * A message is its style, one digit (PAM's: 1 a prompt without echo, 2 with echo, 3 an error, 4 information),
 * then its text, ended by a NUL byte; an answer is a line.
 *
 * PAM's few declarations are written here (Linux-PAM's values, its stable ABI) rather than taken from its
 * headers, which a machine without libpam's development package lacks; its functions come from the libpam that
 * sshd has loaded. Built once per emulator by boot.py (cc -shared), linked into each worker's directory.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct pam_handle pam_handle_t;
struct pam_message { int msg_style; const char *msg; };
struct pam_response { char *resp; int resp_retcode; };
struct pam_conv {
    int (*conv)(int, const struct pam_message **, struct pam_response **, void *);
    void *appdata_ptr;
};
extern int pam_get_user(pam_handle_t *, const char **, const char *);
extern int pam_get_item(const pam_handle_t *, int, const void **);

#define PAM_SUCCESS 0
#define PAM_PERM_DENIED 6
#define PAM_AUTH_ERR 7
#define PAM_CONV 5
#define MAX_ARGS 32
#define MAX_MESSAGE 8192

static int converse(pam_handle_t *pamh, int style, const char *text, char **answer) {
    const struct pam_conv *conv = NULL;
    if (pam_get_item(pamh, PAM_CONV, (const void **)&conv) != PAM_SUCCESS || conv == NULL || conv->conv == NULL)
        return -1;
    struct pam_message message = {style, text};
    const struct pam_message *messages[1] = {&message};
    struct pam_response *response = NULL;
    if (conv->conv(1, messages, &response, conv->appdata_ptr) != PAM_SUCCESS)
        return -1;
    if (response != NULL) {
        if (answer != NULL) {
            *answer = response->resp;
        } else if (response->resp != NULL) {
            free(response->resp);
        }
        free(response);
    }
    return 0;
}

static int write_all(int fd, const char *data, size_t n) {
    while (n > 0) {
        ssize_t done = write(fd, data, n);
        if (done < 0 && errno == EINTR)
            continue;
        if (done <= 0)
            return -1;
        data += done;
        n -= (size_t)done;
    }
    return 0;
}

/* The program's messages read off FROM, each carried to the conversation; answers written to TO. */
static int relay(pam_handle_t *pamh, FILE *from, int to) {
    char message[MAX_MESSAGE + 1];
    for (;;) {
        int c = fgetc(from), style, n = 0;
        if (c == EOF)
            return 0;
        style = c - '0';
        while ((c = fgetc(from)) != EOF && c != '\0')
            if (n < MAX_MESSAGE)
                message[n++] = (char)c;
        message[n] = '\0';
        if (style == 1 || style == 2) {
            char *answer = NULL;
            if (converse(pamh, style, message, &answer) != 0)
                return -1;
            int failed = write_all(to, answer ? answer : "", answer ? strlen(answer) : 0) || write_all(to, "\n", 1);
            if (answer != NULL) {
                memset(answer, 0, strlen(answer));
                free(answer);
            }
            if (failed)
                return -1;
        } else if (converse(pamh, style, message, NULL) != 0) {
            return -1;
        }
    }
}

int pam_sm_authenticate(pam_handle_t *pamh, int flags, int argc, const char **argv) {
    (void)flags;
    const char *user = NULL;
    if (argc < 1 || argc > MAX_ARGS || pam_get_user(pamh, &user, NULL) != PAM_SUCCESS || user == NULL)
        return PAM_PERM_DENIED;
    int down[2], up[2];
    if (pipe(down) != 0)
        return PAM_PERM_DENIED;
    if (pipe(up) != 0) {
        close(down[0]);
        close(down[1]);
        return PAM_PERM_DENIED;
    }
    pid_t pid = fork();
    if (pid < 0)
        return PAM_PERM_DENIED;
    if (pid == 0) {
        char *args[MAX_ARGS + 2];
        for (int i = 0; i < argc; i++)
            args[i] = (char *)argv[i];
        args[argc] = (char *)user;
        args[argc + 1] = NULL;
        dup2(down[0], 0);
        dup2(up[1], 1);
        close(down[0]);
        close(down[1]);
        close(up[0]);
        close(up[1]);
        signal(SIGPIPE, SIG_DFL);
        execv(args[0], args);
        _exit(127);
    }
    close(down[0]);
    close(up[1]);
    FILE *from = fdopen(up[0], "r");
    int relayed = from != NULL ? relay(pamh, from, down[1]) : -1;
    close(down[1]);
    if (from != NULL)
        fclose(from);
    else
        close(up[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (relayed != 0) {
        return PAM_AUTH_ERR;
    }
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? PAM_SUCCESS : PAM_AUTH_ERR;
}

int pam_sm_setcred(pam_handle_t *pamh, int flags, int argc, const char **argv) {
    (void)pamh;
    (void)flags;
    (void)argc;
    (void)argv;
    return PAM_SUCCESS;
}
