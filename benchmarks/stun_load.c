/* STUN Binding load generator for benchmarks/stun.py.
 *
 * Keeps WINDOW requests in flight on each of NSOCK UDP sockets (distinct source
 * ports, like distinct clients), counts valid Binding success responses whose
 * transaction id it sent, and prints one line:
 *     sent=<n> received=<n> seconds=<measured> rate=<responses/s>
 * Counting starts after WARMUP seconds and stops at WARMUP + DURATION.
 * A socket that gets no answer for 200 ms is refilled (lost packets).
 *
 * usage: stun_load HOST PORT DURATION WARMUP NSOCK WINDOW [echo]
 * With "echo", responses of type 0x0001 (a plain echo server) are counted.
 * Built by benchmarks/stun.py with `cc -O2`. Loopback only by intent.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAXSOCK 256
#define BATCH 64

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 7 && argc != 8) {
        fprintf(stderr, "usage: %s HOST PORT DURATION WARMUP NSOCK WINDOW [echo]\n", argv[0]);
        return 2;
    }
    const char *host = argv[1];
    int port = atoi(argv[2]);
    double duration = atof(argv[3]), warmup = atof(argv[4]);
    int nsock = atoi(argv[5]), window = atoi(argv[6]);
    unsigned char first = (argc == 8 && strcmp(argv[7], "echo") == 0) ? 0x00 : 0x01;
    if (nsock < 1 || nsock > MAXSOCK || window < 1 || window > BATCH) return 2;

    struct sockaddr_in dst = {0};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(port);
    if (inet_pton(AF_INET, host, &dst.sin_addr) != 1) return 2;

    int ep = epoll_create1(0);
    int fds[MAXSOCK];
    int inflight[MAXSOCK];
    double last_rx[MAXSOCK];
    uint32_t seq = 1;
    for (int i = 0; i < nsock; i++) {
        fds[i] = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
        int buf = 4 << 20;
        setsockopt(fds[i], SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
        setsockopt(fds[i], SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
        if (connect(fds[i], (struct sockaddr *)&dst, sizeof dst) != 0) { perror("connect"); return 1; }
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        epoll_ctl(ep, EPOLL_CTL_ADD, fds[i], &ev);
        inflight[i] = 0;
        last_rx[i] = 0;
    }

    /* Binding request: type 0x0001, length 0, magic cookie, 12-byte txid whose
     * first 4 bytes are "CRBM" and next 4 a sequence number. */
    unsigned char req[BATCH][20];
    struct mmsghdr smsg[BATCH];
    struct iovec siov[BATCH];
    for (int k = 0; k < BATCH; k++) {
        memset(req[k], 0, 20);
        req[k][1] = 0x01;
        req[k][4] = 0x21; req[k][5] = 0x12; req[k][6] = 0xa4; req[k][7] = 0x42;
        memcpy(req[k] + 8, "CRBM", 4);
        siov[k].iov_base = req[k];
        siov[k].iov_len = 20;
        memset(&smsg[k], 0, sizeof smsg[k]);
        smsg[k].msg_hdr.msg_iov = &siov[k];
        smsg[k].msg_hdr.msg_iovlen = 1;
    }
    unsigned char rbuf[BATCH][2048];
    struct mmsghdr rmsg[BATCH];
    struct iovec riov[BATCH];
    for (int k = 0; k < BATCH; k++) {
        riov[k].iov_base = rbuf[k];
        riov[k].iov_len = sizeof rbuf[k];
        memset(&rmsg[k], 0, sizeof rmsg[k]);
        rmsg[k].msg_hdr.msg_iov = &riov[k];
        rmsg[k].msg_hdr.msg_iovlen = 1;
    }

    unsigned long long sent = 0, received = 0, counted = 0, sent_counted = 0;
    double start = now(), t_begin = start + warmup, t_end = t_begin + duration;

#define SEND(i, n) do { \
        int _n = (n); \
        for (int k = 0; k < _n; k++) { uint32_t s = htonl(seq++); memcpy(req[k] + 12, &s, 4); } \
        int _r = sendmmsg(fds[i], smsg, _n, 0); \
        if (_r > 0) { inflight[i] += _r; sent += _r; if (t >= t_begin && t < t_end) sent_counted += _r; } \
    } while (0)

    double t = now();
    for (int i = 0; i < nsock; i++) { SEND(i, window); last_rx[i] = t; }
    struct epoll_event events[MAXSOCK];
    while ((t = now()) < t_end) {
        int n = epoll_wait(ep, events, MAXSOCK, 10);
        t = now();
        for (int e = 0; e < n; e++) {
            int i = (int)events[e].data.u32;
            int got = recvmmsg(fds[i], rmsg, BATCH, MSG_DONTWAIT, NULL);
            if (got <= 0) continue;
            int ok = 0;
            for (int k = 0; k < got; k++) {
                unsigned char *p = rbuf[k];
                if (rmsg[k].msg_len >= 20 && p[0] == first && p[1] == 0x01 &&
                    memcmp(p + 8, "CRBM", 4) == 0)
                    ok++;
            }
            received += ok;
            if (t >= t_begin) counted += ok;
            inflight[i] -= got;
            if (inflight[i] < 0) inflight[i] = 0;
            last_rx[i] = t;
            int refill = window - inflight[i];
            if (refill > 0) SEND(i, refill);
        }
        for (int i = 0; i < nsock; i++) {
            if (t - last_rx[i] > 0.2) { /* lost requests: start over on this socket */
                inflight[i] = 0;
                SEND(i, window);
                last_rx[i] = t;
            }
        }
    }
    printf("sent=%llu received=%llu counted=%llu seconds=%.3f rate=%.1f\n", sent, received,
           counted, duration, counted / duration);
    return 0;
}
