/* The logger the tools hand to a plugin's init: NCCL's ncclDebugLogger_t is C-variadic and
 * plugins call it with printf formats and arguments of any type, which only C can read
 * (stable Rust cannot define a variadic function). It formats the line and passes it to the
 * sink the Rust side set; a line longer than the buffer is cut, never overrun. */
#include <stdarg.h>
#include <stdio.h>

#include "nccl_net.h"

typedef void (*tools_log_sink)(ncclDebugLogLevel level, unsigned long flags, const char *file,
                               int line, const char *fmt, const char *text);

static tools_log_sink sink;

void nccl_net_tools_set_log_sink(tools_log_sink s) { __atomic_store_n(&sink, s, __ATOMIC_RELEASE); }

void nccl_net_tools_logger(ncclDebugLogLevel level, unsigned long flags, const char *file,
                           int line, const char *fmt, ...) {
  char text[4096];
  text[0] = '\0';
  if (fmt != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
  }
  tools_log_sink s = __atomic_load_n(&sink, __ATOMIC_ACQUIRE);
  if (s != NULL) s(level, flags, file, line, fmt, text);
}

/* It is one: the compiler checks the signature against NCCL's. */
ncclDebugLogger_t nccl_net_tools_logger_checked = nccl_net_tools_logger;
