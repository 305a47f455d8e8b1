// room-service console: the little script the pages use. Everything works without it, except live progress.
(function () {
  "use strict";

  // "select every row on this page"
  var all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", function () {
      var boxes = document.querySelectorAll('table.rows input[type="checkbox"][name]');
      for (var i = 0; i < boxes.length; i++) {
        if (!boxes[i].disabled) { boxes[i].checked = all.checked; }
      }
    });
  }

  // a replay job's progress: poll its JSON until it is finished
  var job = document.getElementById("job");
  if (job && job.dataset.state === "running") {
    var url = job.dataset.jobUrl;
    var show = function (data) {
      document.getElementById("job-state").textContent = data.state;
      document.getElementById("job-done").textContent = data.done;
      document.getElementById("job-total").textContent = data.total;
      var bar = document.getElementById("job-progress");
      bar.max = data.total || 1;
      bar.value = data.done;
      var s = data.summary || {};
      if (data.state !== "running") {
        var text = data.error ? data.error :
          "replayed " + s.replayed + ", not failed " + s.not_failed + ", not found " + s.not_found +
          ", undecodable " + s.undecodable + ", no targets " + s.no_targets;
        document.getElementById("job-summary").textContent = text;
        job.dataset.state = data.state;
      }
    };
    var poll = function () {
      fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
        .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
        .then(function (data) {
          show(data);
          if (data.state === "running") { setTimeout(poll, 500); }
        })
        .catch(function () { setTimeout(poll, 2000); });
    };
    setTimeout(poll, 300);
  }
})();
