/*
 * A DTLS 1.2 PSK client on mbedTLS 2.28, standing in for UnityTLS (Unity
 * Transport's closed mbedTLS wrapper, reference unity-secure-transports.md §1)
 * in tests/interop/test_relay_mbedtls.py.
 *
 * Usage: mbedtls_dtls_client HOST PORT IDENTITY_HEX PSK_HEX STEP...
 *        mbedtls_dtls_client HOST PORT ca:CA_PEM SERVER_NAME STEP...
 *   The first form is DTLS-PSK (the Unity Relay); the second verifies the
 *   server's certificate against CA_PEM and SERVER_NAME (TURN over DTLS).
 *   STEP "w:HEX"  writes HEX as one DTLS application-data record;
 *   STEP "r"      reads one record and prints it as a hex line on stdout.
 * After the handshake it prints "ciphersuite <name>" and "version <name>" on
 * stdout, and at the end sends close_notify.
 *
 * Like UnityTLS for Relay+DTLS (reference §1.3): identity and PSK are binary
 * (the 16 raw allocation-id bytes and the 64-byte decoded key), mbedTLS's
 * default ciphersuite list, and mbedTLS's own HelloVerifyRequest handling.
 *
 * Debian builds mbedTLS with the default MBEDTLS_PSK_MAX_LEN of 32
 * (mbedtls/ssl.h), so mbedtls_ssl_conf_psk() refuses a 64-byte key. UnityTLS
 * is built with a larger limit (Unity Relay keys are 64 bytes); this client
 * gets the same effect by configuring a placeholder key through the API and
 * then installing the real key in the configuration's public psk/psk_len
 * fields. The premaster secret buffer is sized by the largest key exchange
 * (MBEDTLS_PREMASTER_SIZE, DHM: 1024 bytes), so a 64-byte PSK fits. Every
 * byte on the wire is still produced and checked by mbedTLS.
 *
 * Exit codes: 0 ok, 2 usage, 3 setup or connect, 4 handshake, 5 write,
 * 6 read timeout, 7 read error, 8 close_notify.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mbedtls/ctr_drbg.h>
#include <mbedtls/entropy.h>
#include <mbedtls/error.h>
#include <mbedtls/net_sockets.h>
#include <mbedtls/platform_util.h>
#include <mbedtls/ssl.h>
#include <mbedtls/timing.h>
#include <mbedtls/x509_crt.h>

/* Per read: generous for a loaded CI machine; the test bounds the whole run. */
#define READ_TIMEOUT_MS 5000
/* Handshake retransmission: RFC 6347 §4.2.4.1 starts at 1 s and doubles; 4 s
 * max gives up after 1+2+4 s rather than mbedTLS's default 60 s. */
#define HANDSHAKE_MIN_MS 1000
#define HANDSHAKE_MAX_MS 4000
/* A Unity Relay message is at most a few hundred bytes; RELAY payloads stay
 * under one MTU. */
#define MAX_RECORD 2048

static void report(const char *what, int ret) {
    char text[160];
    mbedtls_strerror(ret, text, sizeof text);
    fprintf(stderr, "%s: -0x%04X %s\n", what, (unsigned)-ret, text);
}

/* Decodes HEX into a new buffer; NULL on odd length or a non-hex digit. */
static unsigned char *from_hex(const char *hex, size_t *length) {
    size_t digits = strlen(hex);
    if (digits % 2 != 0)
        return NULL;
    unsigned char *out = calloc(1, digits / 2 + 1);
    if (out == NULL)
        return NULL;
    for (size_t i = 0; i < digits / 2; i++) {
        unsigned value;
        if (sscanf(hex + 2 * i, "%2x", &value) != 1) {
            free(out);
            return NULL;
        }
        out[i] = (unsigned char)value;
    }
    *length = digits / 2;
    return out;
}

static int handshake(mbedtls_ssl_context *ssl) {
    int ret;
    do {
        ret = mbedtls_ssl_handshake(ssl);
    } while (ret == MBEDTLS_ERR_SSL_WANT_READ || ret == MBEDTLS_ERR_SSL_WANT_WRITE);
    return ret;
}

static int write_record(mbedtls_ssl_context *ssl, const char *hex) {
    size_t length;
    unsigned char *data = from_hex(hex, &length);
    if (data == NULL) {
        fprintf(stderr, "bad hex in write step\n");
        return 2;
    }
    int ret;
    do {
        ret = mbedtls_ssl_write(ssl, data, length);
    } while (ret == MBEDTLS_ERR_SSL_WANT_READ || ret == MBEDTLS_ERR_SSL_WANT_WRITE);
    free(data);
    if (ret < 0 || (size_t)ret != length) {
        report("write", ret);
        return 5;
    }
    return 0;
}

static int read_record(mbedtls_ssl_context *ssl) {
    unsigned char buffer[MAX_RECORD];
    int ret;
    do {
        ret = mbedtls_ssl_read(ssl, buffer, sizeof buffer);
    } while (ret == MBEDTLS_ERR_SSL_WANT_READ || ret == MBEDTLS_ERR_SSL_WANT_WRITE);
    if (ret == MBEDTLS_ERR_SSL_TIMEOUT) {
        report("read", ret);
        return 6;
    }
    if (ret <= 0) {
        report("read", ret);
        return 7;
    }
    for (int i = 0; i < ret; i++)
        printf("%02x", buffer[i]);
    printf("\n");
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr,
                "usage: %s HOST PORT (IDENTITY_HEX PSK_HEX | ca:CA_PEM SERVER_NAME) "
                "[w:HEX|r]...\n",
                argv[0]);
        return 2;
    }
    const char *ca_file = strncmp(argv[3], "ca:", 3) == 0 ? argv[3] + 3 : NULL;
    size_t identity_length = 0, psk_length = 0;
    unsigned char *identity = NULL;
    unsigned char *psk = NULL;
    if (ca_file == NULL) {
        identity = from_hex(argv[3], &identity_length);
        psk = from_hex(argv[4], &psk_length);
        if (identity == NULL || psk == NULL || identity_length == 0 || psk_length == 0) {
            fprintf(stderr, "bad identity or psk hex\n");
            return 2;
        }
    }

    mbedtls_net_context net;
    mbedtls_entropy_context entropy;
    mbedtls_ctr_drbg_context drbg;
    mbedtls_ssl_config conf;
    mbedtls_ssl_context ssl;
    mbedtls_timing_delay_context timer;
    mbedtls_x509_crt ca;
    mbedtls_x509_crt_init(&ca);
    mbedtls_net_init(&net);
    mbedtls_entropy_init(&entropy);
    mbedtls_ctr_drbg_init(&drbg);
    mbedtls_ssl_config_init(&conf);
    mbedtls_ssl_init(&ssl);

    int code = 3;
    int ret;
    static const unsigned char placeholder[32];
    if ((ret = mbedtls_ctr_drbg_seed(&drbg, mbedtls_entropy_func, &entropy, NULL, 0)) != 0) {
        report("ctr_drbg_seed", ret);
        goto done;
    }
    if ((ret = mbedtls_ssl_config_defaults(&conf, MBEDTLS_SSL_IS_CLIENT,
                                           MBEDTLS_SSL_TRANSPORT_DATAGRAM,
                                           MBEDTLS_SSL_PRESET_DEFAULT)) != 0) {
        report("ssl_config_defaults", ret);
        goto done;
    }
    mbedtls_ssl_conf_rng(&conf, mbedtls_ctr_drbg_random, &drbg);
    mbedtls_ssl_conf_read_timeout(&conf, READ_TIMEOUT_MS);
    mbedtls_ssl_conf_handshake_timeout(&conf, HANDSHAKE_MIN_MS, HANDSHAKE_MAX_MS);
    if (ca_file != NULL) {
        if ((ret = mbedtls_x509_crt_parse_file(&ca, ca_file)) != 0) {
            report("x509_crt_parse_file", ret);
            goto done;
        }
        mbedtls_ssl_conf_ca_chain(&conf, &ca, NULL);
        mbedtls_ssl_conf_authmode(&conf, MBEDTLS_SSL_VERIFY_REQUIRED);
    } else {
        size_t placeholder_length =
            psk_length < sizeof placeholder ? psk_length : sizeof placeholder;
        if ((ret = mbedtls_ssl_conf_psk(&conf, placeholder, placeholder_length, identity,
                                        identity_length)) != 0) {
            report("ssl_conf_psk", ret);
            goto done;
        }
        /* The real key, past the library's compile-time limit (see the top). */
        mbedtls_platform_zeroize(conf.psk, conf.psk_len);
        free(conf.psk);
        conf.psk = psk;
        conf.psk_len = psk_length;
        psk = NULL; /* now owned (zeroized and freed) by mbedtls_ssl_config_free */
    }

    if ((ret = mbedtls_net_connect(&net, argv[1], argv[2], MBEDTLS_NET_PROTO_UDP)) != 0) {
        report("net_connect", ret);
        goto done;
    }
    if ((ret = mbedtls_ssl_setup(&ssl, &conf)) != 0) {
        report("ssl_setup", ret);
        goto done;
    }
    /* The name the certificate must carry (mbedTLS 2.28 checks DNS names). */
    if (ca_file != NULL && (ret = mbedtls_ssl_set_hostname(&ssl, argv[4])) != 0) {
        report("ssl_set_hostname", ret);
        goto done;
    }
    mbedtls_ssl_set_bio(&ssl, &net, mbedtls_net_send, mbedtls_net_recv,
                        mbedtls_net_recv_timeout);
    mbedtls_ssl_set_timer_cb(&ssl, &timer, mbedtls_timing_set_delay,
                             mbedtls_timing_get_delay);

    if ((ret = handshake(&ssl)) != 0) {
        report("handshake", ret);
        code = 4;
        goto done;
    }
    printf("ciphersuite %s\nversion %s\n", mbedtls_ssl_get_ciphersuite(&ssl),
           mbedtls_ssl_get_version(&ssl));
    fflush(stdout);

    code = 0;
    for (int i = 5; i < argc && code == 0; i++) {
        if (strncmp(argv[i], "w:", 2) == 0)
            code = write_record(&ssl, argv[i] + 2);
        else if (strcmp(argv[i], "r") == 0)
            code = read_record(&ssl);
        else {
            fprintf(stderr, "unknown step %s\n", argv[i]);
            code = 2;
        }
    }
    do {
        ret = mbedtls_ssl_close_notify(&ssl);
    } while (ret == MBEDTLS_ERR_SSL_WANT_WRITE);
    if (ret != 0) {
        report("close_notify", ret);
        if (code == 0)
            code = 8;
    }

done:
    if (psk != NULL) {
        mbedtls_platform_zeroize(psk, psk_length);
        free(psk);
    }
    free(identity);
    mbedtls_net_free(&net);
    mbedtls_x509_crt_free(&ca);
    mbedtls_ssl_free(&ssl);
    mbedtls_ssl_config_free(&conf);
    mbedtls_ctr_drbg_free(&drbg);
    mbedtls_entropy_free(&entropy);
    return code;
}
