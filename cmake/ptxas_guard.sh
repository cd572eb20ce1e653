#!/bin/sh
# The sm90 kernels' compiler launcher (cmake/fa4_sm90.cmake): runs the compile, passes its
# messages on, and fails it when ptxas reports wgmma instructions serialized (C7510). ptxas prints
# that as information, which -Xptxas=-Werror lets pass, yet it costs a kernel ~20 % of its speed:
# a call between two wgmmas (a helper the compiler did not inline) is the usual cause.
log=$(mktemp) || exit 1
"$@" 2>"$log"
rc=$?
cat "$log" >&2
if [ $rc -eq 0 ] && grep -q "(C7510)" "$log"; then
  echo "error: ptxas serialized wgmma instructions (C7510, above); inline the function it names" >&2
  rc=1
fi
rm -f "$log"
exit $rc
