#!/usr/bin/env bash
# Run the kvaudit example end to end and check that every command behaves as it should.
#
#     bash examples/run_example.sh OUT_DIR
#
# Writes the example's dump sets under OUT_DIR (make_example.py), checksums the producer,
# diffs the producer with the intact consumer (must exit 0) and with the consumer that has
# a planted fault (must exit 1, naming where it broke). Calls `python` and `kvaudit` from
# PATH. Exits 0 only when everything behaved as expected, else non-zero with a message.
set -u

if [ "$#" -ne 1 ]; then
    echo "usage: bash examples/run_example.sh OUT_DIR" >&2
    exit 2
fi
out="$1"
here="$(dirname "${BASH_SOURCE[0]}")"

fail() {
    echo "run_example: FAILED: $*" >&2
    exit 1
}

step() {
    echo
    echo "\$ $*"
}

for tool in python kvaudit; do
    command -v "$tool" >/dev/null 2>&1 || fail "'$tool' is not on PATH"
done

step python "$here/make_example.py" "$out"
python "$here/make_example.py" "$out" || fail "make_example.py exited with status $?"

step kvaudit checksum "$out/producer"
kvaudit checksum "$out/producer" || fail "kvaudit checksum exited with status $?"

step kvaudit diff "$out/producer" "$out/consumer"
kvaudit diff "$out/producer" "$out/consumer"
status=$?
[ "$status" -eq 0 ] || fail "kvaudit diff of the intact consumer exited with status $status, expected 0"

step kvaudit diff "$out/producer" "$out/consumer-broken"
kvaudit diff "$out/producer" "$out/consumer-broken"
status=$?
[ "$status" -eq 1 ] || fail "kvaudit diff of the broken consumer exited with status $status, expected 1"

echo
echo "run_example: OK: the intact consumer matches (status 0), the planted fault is found (status 1)"
