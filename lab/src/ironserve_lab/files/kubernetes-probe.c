/* The lab Kubernetes node's test program (kubernetes_node.py), built here with gcc -static so
 * that the test image needs nothing else. Each mode prints one line, which is also the container's
 * termination message: the test reads it through the API (the API server cannot reach the kubelet in the VM,
 * so there are no `kubectl logs`).
 *
 *   probe ptrace              ptrace(PTRACE_PEEKUSER) of itself: ESRCH where the syscall is allowed (the
 *                             process is not traced), EPERM where a seccomp profile refuses it
 *   probe serve PORT          answer every TCP connection with "hello from <hostname>" until SIGTERM
 *   probe connect IP PORT     print the first line the server sends (retrying for 30 s), exit 1 on failure
 */
#include <arpa/inet.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static void report(const char *line) {
  FILE *log = fopen("/dev/termination-log", "w");
  printf("%s\n", line);
  fflush(stdout);
  if (log) {
    fprintf(log, "%s\n", line);
    fclose(log);
  }
}

static int probe_ptrace(void) {
  char line[64];
  /* The raw syscall: for PEEK requests glibc's wrapper passes its own data pointer and folds the result. */
  long result = syscall(SYS_ptrace, PTRACE_PEEKUSER, getpid(), 0, 0);
  const char *name = result != -1 ? "allowed" : errno == EPERM ? "EPERM" : errno == ESRCH ? "ESRCH" : "other";
  snprintf(line, sizeof line, "ptrace: %s (errno %d)", name, result == -1 ? errno : 0);
  report(line);
  return 0;
}

static void stop(int signal_number) {
  (void)signal_number;
  _exit(0);
}

static int serve(int port) {
  char host[64] = "?", line[128];
  struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = INADDR_ANY};
  int one = 1, server = socket(AF_INET, SOCK_STREAM, 0);
  /* As PID 1 of its container, SIGTERM without a handler is ignored: pod deletion and the VM's shutdown would
   * wait out their timeouts. */
  signal(SIGTERM, stop);
  gethostname(host, sizeof host - 1);
  snprintf(line, sizeof line, "hello from %s\n", host);
  setsockopt(server, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (server < 0 || bind(server, (struct sockaddr *)&address, sizeof address) || listen(server, 16)) {
    perror("serve");
    return 1;
  }
  printf("serving on port %d\n", port);
  fflush(stdout);
  for (;;) {
    int client = accept(server, NULL, NULL);
    if (client >= 0) {
      (void)!write(client, line, strlen(line));
      close(client);
    }
  }
}

static int connect_to(const char *ip, int port) {
  char answer[128] = {0}, line[192];
  struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(port)};
  if (inet_pton(AF_INET, ip, &address.sin_addr) != 1) {
    report("connect: not an IPv4 address");
    return 1;
  }
  for (int attempt = 0; attempt < 30; attempt++) {
    int sock = socket(AF_INET, SOCK_STREAM, 0);
    if (sock >= 0 && connect(sock, (struct sockaddr *)&address, sizeof address) == 0) {
      ssize_t got = read(sock, answer, sizeof answer - 1);
      close(sock);
      if (got > 0) {
        answer[strcspn(answer, "\n")] = 0;
        snprintf(line, sizeof line, "connect: %s", answer);
        report(line);
        return 0;
      }
    }
    if (sock >= 0) close(sock);
    sleep(1);
  }
  snprintf(line, sizeof line, "connect: failed: %s", strerror(errno));
  report(line);
  return 1;
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "ptrace") == 0) return probe_ptrace();
  if (argc == 3 && strcmp(argv[1], "serve") == 0) return serve(atoi(argv[2]));
  if (argc == 4 && strcmp(argv[1], "connect") == 0) return connect_to(argv[2], atoi(argv[3]));
  fprintf(stderr, "usage: probe ptrace | serve PORT | connect IP PORT\n");
  return 2;
}
